"""The output processor: stop strings found incrementally stop a request at the same token, and cut its text at
the same place, as decoding the whole output after every token (byte-level BPE with multi-byte characters cut
between tokens, a SentencePiece-style tokenizer that drops the first token's leading space, and WordPiece and
Unigram tokenizers whose clean-up rewrites the joined text: ``dog ' f`` decodes to ``dog'f``)."""

from __future__ import annotations

import random

import pytest

from batchjob.engine.output import OutputProcessor
from batchjob.engine.request import Request
from batchjob.sampling import SamplingParams
from tests.tiny_models import make_scripted_model, make_tokenizer

pytestmark = pytest.mark.timeout(120)

TEXT = "the cat sat. The dog ran, and the bird — très vite — flew: naïve café, 東京 and 🎉!\n"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_])
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _cleanup_tokenizer(kind: str):
    """A WordPiece (BERT-style) or Unigram (SentencePiece-style) tokenizer with transformers' clean-up, which
    joins `` ' `` and the words around it, and takes the space before ``.`` and ``,``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["dog", "'", "f", "is", "ok", "the", "cat", "s", "t", ".", ",", "n", "re", "m", "ve"]
    if kind == "wordpiece":
        vocab = ["[UNK]", "[SEP]", *words, "##s", "##t", "##og"]
        tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        special = {"unk_token": "[UNK]", "sep_token": "[SEP]"}
    else:
        pieces = ["<unk>", "</s>", *(f"\u2581{w}" for w in words), *words]
        tok = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
        special = {"unk_token": "<unk>", "eos_token": "</s>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True, **special)


@pytest.fixture(scope="module")
def wordpiece():
    return _cleanup_tokenizer("wordpiece")


@pytest.fixture(scope="module")
def unigram_cleanup():
    return _cleanup_tokenizer("unigram")


def _naive(tokenizer, output: list[int], stops: list[str]) -> tuple[int, int] | None:
    """(tokens, position): the first prefix of ``output`` whose text holds a stop string, and where."""
    for n in range(1, len(output) + 1):
        text = tokenizer.decode(output[:n], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return n, min(hits)
    return None


def _incremental(tokenizer, prompt: list[int], output: list[int], stops: list[str]) -> tuple[int, int] | None:
    proc = OutputProcessor(tokenizer)
    req = Request("r", list(prompt), len(prompt), SamplingParams(stop=stops), 0.0)
    for tok in output:
        req.token_ids.append(tok)
        if proc.stop_string_found(req):
            assert req.stop is not None and req.stop.match is not None
            return req.num_output_tokens, req.stop.match
    return None


@pytest.mark.parametrize("which", ["byte_level", "metaspace", "wordpiece", "unigram_cleanup"])
def test_incremental_stop_strings_match_decoding_the_whole_output(which, request):
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(0)
    words = TEXT.split(" ")
    cases = 0
    for _ in range(150):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 30)))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if rng.random() < 0.3:  # random ids too: byte tokens that do not make whole characters
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if full and rng.random() < 0.8:
                i = rng.randrange(len(full))
                stops.append(full[i : i + rng.randrange(1, 8)])
            else:
                stops.append(rng.choice(["zzz", "é,", ". T", "🎉", "\n"]))
        # (a stop string holding U+FFFD, which random byte tokens decode to, is refused: SamplingParams)
        stops = [s for s in stops if s and "\ufffd" not in s] or ["zzz"]
        want = _naive(tokenizer, ids, stops)
        assert _incremental(tokenizer, [1, 2], ids, stops) == want, (ids, stops)
        cases += want is not None
    assert cases > 50  # most cases stop somewhere


def test_found_stays_found(byte_level):
    """A resumed request already past its stop string is checked twice (at admission, at the next step)."""
    proc = OutputProcessor(byte_level)
    ids = byte_level("the cat sat. The dog", add_special_tokens=False).input_ids
    req = Request("r", [1] + ids, 1, SamplingParams(stop=["cat"]), 0.0)
    assert proc.stop_string_found(req) and proc.stop_string_found(req)
    assert req.stop is not None and req.stop.match == 4


@pytest.mark.parametrize("which", ["wordpiece", "unigram_cleanup"])
def test_stop_string_that_only_the_clean_up_makes(which, request):
    """``dog``, ``'``, ``f`` decode to ``dog'f`` only together (no window of them does): the stop ``g'f`` is
    found at ``f``, the text cut before it."""
    tokenizer = request.getfixturevalue(which)
    pieces = (
        ["dog", "'", "f", "is", "ok"]
        if which == "wordpiece"
        else ["\u2581dog", "\u2581'", "\u2581f", "\u2581is"]
    )
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids[:3], skip_special_tokens=True) == "dog'f"
    for stop, where in [("g'f", 2), ("dog'f", 0), ("'f", 3)]:
        assert _incremental(tokenizer, [1], ids, [stop]) == _naive(tokenizer, ids, [stop]) == (3, where)
    assert not OutputProcessor(tokenizer).window_safe  # each check decodes the whole output


def test_window_safe_tokenizers_keep_the_short_window(byte_level, metaspace):
    """Byte-level BPE and SentencePiece-style BPE decode in windows (no whole-output decode per token)."""
    assert OutputProcessor(byte_level).window_safe and OutputProcessor(metaspace).window_safe


@pytest.mark.engine
def test_engine_stops_at_a_string_the_clean_up_makes(unigram_cleanup, tmp_path):
    """End to end: the generated ``the dog ' f is ok`` reads ``the dog'f is ok``; the stop ``g'f`` ends it at
    ``f`` with the text before it."""
    from batchjob import Engine

    chain = unigram_cleanup.convert_tokens_to_ids(
        [f"\u2581{w}" for w in ["the", "dog", "'", "f", "is", "ok"]]
    )
    make_scripted_model(tmp_path, unigram_cleanup, chain)
    engine = Engine.from_pretrained(str(tmp_path), dtype="float32", device="cpu")
    plain = engine.generate([chain[:1]], SamplingParams(max_new_tokens=10, temperature=0))[0]
    assert plain.token_ids[:5] == chain[1:] and plain.text == "dog'f is ok"
    out = engine.generate([chain[:1]], SamplingParams(max_new_tokens=10, temperature=0, stop=["g'f"]))[0]
    assert (out.token_ids, out.text, out.stopped_at_string) == (chain[1:4], "do", True)
