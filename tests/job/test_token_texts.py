"""--logprobs token texts with a SentencePiece-style tokenizer (Metaspace, byte fallback): each token's text is
what it adds to the output's text, so the tokens join to ``generated_text``, and the OpenAI export's
``text_offset`` and ``bytes`` follow them (a token decoded alone loses its word-start space: ``▁Pa`` read
``Pa``, and offsets ran past the text)."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job.export import _openai_logprobs, _text_offsets
from batchjob.job.rows import generate
from batchjob.job.rows.token_texts import TokenTexts
from tests.tiny_models import make_scripted_model

# the generated chain after the prompt "Do": "em😀 Pa日 T." (the emoji and 日 as byte tokens), then EOS
CHAIN = ["▁Do", "▁em", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁Pa", "<0xE6>", "<0x97>", "<0xA5>", "▁T", "."]
TEXT = "em😀 Pa日 T."


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def sp_tokenizer(folder, legacy: bool):
    """A Llama-style tokenizer: byte fallback BPE, ``▁`` for spaces; ``legacy``: Llama 2's decoder (Replace,
    ByteFallback, Fuse, Strip), else the Metaspace decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in [
        "▁",
        "D",
        "o",
        "e",
        "m",
        "P",
        "a",
        "T",
        ".",
        "▁D",
        "▁Do",
        "▁e",
        "▁em",
        "em",
        "▁P",
        "▁Pa",
        "▁T",
    ]:
        vocab.setdefault(piece, len(vocab))
    merges = [
        ("▁", "D"),
        ("▁D", "o"),
        ("▁", "e"),
        ("▁e", "m"),
        ("e", "m"),
        ("▁", "P"),
        ("▁P", "a"),
        ("▁", "T"),
    ]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [
                decoders.ByteFallback(),
                decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
            ]
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.save_pretrained(str(folder))
    return fast


@pytest.mark.engine
@pytest.mark.parametrize("legacy", [True, False])
def test_token_texts_in_context(tmp_path, legacy):
    tok = sp_tokenizer(tmp_path, legacy)
    ids = tok.convert_tokens_to_ids(CHAIN[1:]) + [tok.eos_token_id]
    texts = TokenTexts(tok)
    assert (
        tok.decode([tok.convert_tokens_to_ids("▁Pa")]) == "Pa"
    )  # decoded alone: the word-start space is lost
    other = tok.convert_tokens_to_ids(["▁Pa", "<0xF0>", "</s>"])
    spelled, alts = texts.spell(ids, [other] * len(ids))
    # the emoji and 日 are the texts of the tokens that finish them; EOS is skipped from the text
    assert spelled == ["em", "", "", "", "😀", " Pa", "", "", "日", " T", ".", ""]
    assert "".join(spelled) == TEXT == tok.decode(ids, skip_special_tokens=True)
    # an alternative is spelled as the sampled token at its place: " Pa" after a word, a byte held back; in
    # place of the emoji's last byte, it leaves the three before it unfinished
    assert alts[0] == ["Pa", "", ""] and alts[1] == [" Pa", "", ""] and alts[5] == [" Pa", "", ""]
    assert alts[4][0] == "\ufffd" * 3 + " Pa"
    # an unfinished character at the output's end reads U+FFFD, as in the text
    cut = ids[:3]
    assert (
        texts.spell(cut, [[]] * len(cut))[0] == ["em", "", "\ufffd\ufffd"] == ["em", "", tok.decode(cut)[2:]]
    )


def test_token_logprobs_spells_a_sample_once():
    """The row's ``logprobs`` structs take their texts from one ``spell`` of the sample's tokens, with each
    token's top ``k`` (not the sampled token the engine appends when it is not among them)."""
    asked = []

    def spell(ids, tops):
        asked.append((ids, tops))
        return [f"t{t}" for t in ids], [[f"a{t}" for t in top] for top in tops]

    tops = [[(5, -0.1), (6, -2.0), (9, -3.0)], [(7, -0.5), (8, -1.0)]]
    rows = generate.token_logprobs(tops, [9, 7], 2, spell)
    assert asked == [([9, 7], [[5, 6], [7, 8]])]
    assert rows[0] == {
        "token": "t9",
        "token_id": 9,
        "logprob": -3.0,
        "top_logprobs": [
            {"token": "a5", "token_id": 5, "logprob": -0.1},
            {"token": "a6", "token_id": 6, "logprob": -2.0},
        ],
    }
    assert rows[1]["token"] == "t7" and [x["token"] for x in rows[1]["top_logprobs"]] == ["a7", "a8"]
    # without a tokenizer (a row kind built on its own), each token reads as its id
    assert [t["token"] for t in generate.token_logprobs(tops, [9, 7], 1, generate.spell_ids)] == ["9", "7"]


def test_token_logprobs_refuse_a_list_that_is_not_one_a_token():
    """A per-token list one short of the tokens (a choice's answer beside its token walk's list) was cut to
    the shorter silently: a token's entry could belong to another place."""
    tops = [[(5, -0.1)], [(7, -0.5)]]
    with pytest.raises(ValueError):
        generate.token_logprobs(tops, [5, 7, 9], 1, generate.spell_ids)


def test_text_offsets():
    tokens = ["em", "", "", "", "😀", " Pa", "", "", "日", " T", ".", ""]
    assert _text_offsets(tokens, TEXT) == [0, 2, 2, 2, 2, 3, 6, 6, 6, 7, 9, 10]
    # a stop string cut the text: the tokens past it are at its end, none past it
    assert _text_offsets(tokens, "em😀 P") == [0, 2, 2, 2, 2, 3, 5, 5, 5, 5, 5, 5]
    # think tags split it off: the reasoning's tokens are at 0
    assert _text_offsets(["<think>", "hm", "</think>", "\n\n", "Yes", ""], "Yes") == [0, 0, 0, 0, 0, 3]
    chat = _openai_logprobs([{"token": t, "logprob": -1.0, "top_logprobs": []} for t in tokens], False)
    assert chat is not None
    assert bytes(b for c in chat["content"] for b in c["bytes"]).decode() == TEXT


@pytest.mark.engine
def test_logprobs_tokens_spell_the_text(tmp_path):
    """A job with logprobs on a model with a SentencePiece tokenizer: the ``logprobs`` column's tokens and the
    OpenAI export's tokens, text_offset and bytes follow the generated text."""
    folder = tmp_path / "model"
    tok = sp_tokenizer(folder, legacy=True)
    make_scripted_model(folder, tok, tok.convert_tokens_to_ids(CHAIN))
    requests = tmp_path / "requests.jsonl"
    body = {"prompt": "Do", "max_tokens": 20, "temperature": 0, "logprobs": 2}
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}]
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    args = ["--model", folder, "--dtype", "float32", "--device", "cpu", "--format", "openai"]
    code, text = invoke("run", "--input", requests, "--output", out, *args)
    assert code == 0, text
    (row,) = ds.dataset(out, format="parquet").to_table().to_pylist()
    assert row["generated_text"] == TEXT
    tokens = [t["token"] for t in row["logprobs"]]
    assert "".join(tokens) == TEXT and " Pa" in tokens and tokens[-1] == ""  # EOS: skipped from the text
    code, text = invoke("export", out, "--format", "openai", "--to", tmp_path / "results.jsonl")
    assert code == 0, text
    (line,) = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    choice = line["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT and lp["tokens"] == tokens
    assert all(TEXT[at : at + len(t)] == t for at, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    assert lp["text_offset"][-1] == len(TEXT)  # EOS: at the text's end, not past it
