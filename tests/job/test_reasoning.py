"""Reasoning models: think tags, the reasoning column, answers constrained after the thinking, a bound on it."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
import torch
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.engine import Engine
from batchjob.io.atomic import read_json, write_json
from batchjob.sampling import SamplingParams
from tests.jobproc import sigterm_after_steps
from tests.tiers import engine_fixture
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(300)

THINKING_TEMPLATE = (  # Qwen3's shape: the model opens <think> itself; enable_thinking=false writes an empty block
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
LABELS = ["yes", "no"]


@engine_fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny llama whose tokenizer has <think> and </think> tokens and a template that can turn them off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_model(tmp_path_factory.mktemp("thinker") / "m", "llama")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "q.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"rid": f"q{i}", "question": f"Is review {i} positive?"}) + "\n")
    return path


ROWS = ("--template", "{question}", "--id-column", "rid", "--max-new-tokens", "5")  # how run() reads the rows


def run(data, out, model, *extra, code=0, prompts=ROWS):
    """``batchjob run`` in float64 with ``prompts`` (the data's rows: ``ROWS``; an OpenAI Batch file's:
    ``--format openai``) and ``extra``."""
    args = ["run", "--input", data, "--output", out, "--model", model, "--dtype", "float64", *prompts, *extra]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def rows(out):
    return sorted(
        ds.dataset(out, format="parquet").to_table().to_pylist(maps_as_pydicts="strict"),
        key=lambda r: r["rid"],
    )


def test_constrained_answer_after_bounded_thinking_is_exact(data, thinker, tmp_path):
    out = tmp_path / "out"
    run(data, out, thinker, "--choices", ",".join(LABELS), "--max-reasoning-tokens", "4")
    engine = Engine.from_pretrained(str(thinker), dtype="float64", num_speculative_tokens=0)
    tok = engine.tokenizer
    think, close = tok.convert_tokens_to_ids(["<think>", "</think>"])
    for r in rows(out):
        assert r["generated_text"] in LABELS and r["finish_reason"] == "stop"
        assert sum(r["choice_probs"].values()) == pytest.approx(1.0)  # an Arrow map
        # the same two steps by hand: think greedily from the prompt and <think>, then choose after </think>
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False)["input_ids"] + [think]
        params = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=[close])
        [thought] = engine.generate([ids], params)
        thought_ids = list(thought.token_ids)
        assert (
            r["reasoning"] == tok.decode(thought_ids, skip_special_tokens=True).split("</think>")[0].strip()
        )
        ids += thought_ids + ([] if thought_ids[-1:] == [close] else [close])
        [answer] = engine.generate([ids], SamplingParams(choices=LABELS, temperature=0))
        assert r["generated_text"] == answer.text
        assert r["num_generated_tokens"] == len(thought_ids) + len(answer.token_ids)
        assert r["choice_logprobs"] == pytest.approx(answer.choice_logprobs)


def test_thinking_longer_than_the_context_allows_leaves_room_for_the_answer(data, thinker, tmp_path):
    """A --max-reasoning-tokens past the context: the thinking stops where the close tag and an answer still
    fit, instead of every long thought's answer being refused as a prompt too long for the context."""
    out = tmp_path / "out"
    run(
        data,
        out,
        thinker,
        "--choices",
        ",".join(LABELS),
        "--max-reasoning-tokens",
        "100000",
        "--max-model-len",
        "48",
    )
    for r in rows(out):
        assert r["error"] is None and r["generated_text"] in LABELS, r
        assert r["num_prompt_tokens"] + r["num_generated_tokens"] <= 48


def test_thinking_turned_off_by_the_template_and_free_answers(data, thinker, tmp_path):
    off = tmp_path / "off"
    run(
        data,
        off,
        thinker,
        "--choices",
        ",".join(LABELS),
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    for r in rows(off):  # the template closed the block: one constrained request, nothing to think
        assert r["generated_text"] in LABELS and r["reasoning"] is None
        assert r["num_generated_tokens"] <= 2  # "yes" or "no" and the stop token, no thinking
    free = tmp_path / "free"
    run(data, free, thinker, "--max-reasoning-tokens", "3")
    for r in rows(free):  # bounded thinking, then a free answer of up to --max-new-tokens
        assert r["reasoning"] is not None
        assert 1 <= r["num_generated_tokens"] <= 3 + 5


# constrained answers after bounded, sampled thinking: the resume tests' job
RESUMED = [
    "--choices",
    ",".join(LABELS),
    "--max-reasoning-tokens",
    "4",
    "--temperature",
    "0.8",
    "--seed",
    "2",
]


def test_reasoning_job_resumes_exactly(data, thinker, tmp_path, monkeypatch):
    want, out = tmp_path / "want", tmp_path / "out"
    extra = RESUMED
    run(data, want, thinker, *extra)
    with sigterm_after_steps(6):
        run(data, out, thinker, *extra, "--checkpoint-interval", "0.001", code=75)
    saved = json.loads((out / "_batchjob" / "inflight.json").read_text())["body"]["requests"]
    assert any(len(r["output_ids"]) == 4 for r in saved)  # rows stopped in their answer: saved as thinking
    assert all(r["kind"] == "reasoning" for r in saved)  # each record says what saved it
    assert any(r.get("answering") == [0] for r in saved)  # and which samples were past their thinking
    run(data, out, thinker, *extra)
    assert rows(out) == rows(want)


def test_reasoning_job_resumes_exactly_from_a_checkpoint_without_kinds(data, thinker, tmp_path):
    """A checkpoint written before records named their row kind still loads: the row's prompt and
    parameters decide, as they did, and the resumed job writes what an uninterrupted one does."""
    want, out = tmp_path / "want", tmp_path / "out"
    extra = RESUMED
    run(data, want, thinker, *extra)
    with sigterm_after_steps(6):
        run(data, out, thinker, *extra, "--checkpoint-interval", "0.001", code=75)
    path = out / "_batchjob" / "inflight.json"
    body = read_json(path)
    for r in body["requests"]:
        del r["kind"]
        r.pop("answering", None)
    write_json(path, body)
    run(data, out, thinker, *extra)
    assert rows(out) == rows(want)


def test_tags_given_by_hand_and_missing_tags(data, tiny_model_dir, tmp_path):
    text = run(data, tmp_path / "a", tiny_model_dir, "--max-reasoning-tokens", "2", code=2)
    assert "--max-reasoning-tokens needs the model's think tags" in text
    out = tmp_path / "b"  # tags the tokenizer spells in several tokens: the thinking stops on the text
    run(
        data,
        out,
        tiny_model_dir,
        "--reasoning-tags",
        "[[,]]",
        "--max-reasoning-tokens",
        "3",
        "--choices",
        "a,b",
    )
    for r in rows(out):
        assert r["generated_text"] in ("a", "b") and r["reasoning"] is not None
    plain = tmp_path / "c"  # no tags: no reasoning column
    run(data, plain, tiny_model_dir)
    assert "reasoning" not in rows(plain)[0]
    same = run(
        data, tmp_path / "d", tiny_model_dir, "--reasoning-tags", "<t>,<t>", "--choices", "a,b", code=2
    )
    assert "two different tags" in same  # one tag for both: the thinking would never be told from the answer


def test_a_close_tag_the_model_wrote_inside_other_tokens_is_not_added_again():
    """A close tag of several tokens ends the thinking as a stop string, which may end inside a token the
    model wrote ('o', 'tral' for 'otra'): the answer follows the model's tokens, with no second tag, and the
    text after the tag in that token ('l') begins the answer (a constrained one can't hold it: an error); a
    thinking that ran long gets the tag."""
    from batchjob.engine.output import RequestOutput
    from batchjob.io.readers import Row
    from batchjob.job.reasoning import ReasoningTags
    from batchjob.job.rows.reasoning import Reasoning, thinking_params

    tags = ReasoningTags("<foo>", "otra", (90,), (40, 41))
    pieces = {7: "hm", 40: "o", 41: "tra", 42: "tral", 8: " yes", 9: "m", 2: ""}  # joined when decoded

    def decode(ids):
        return "".join(pieces[t] for t in ids)

    def reasoning_row(params):
        return Reasoning(
            row=Row(0, "q.jsonl", 0, {"q": "hi"}),
            row_id="q0",
            prompt_ids=[5, 6, 90],
            num_prompt_tokens=2,
            params=thinking_params(tags, params, 8),
            answer_params=params,
            tags=tags,
            decode=decode,
        )

    params = SamplingParams(choices=["yes", "no"])
    row = reasoning_row(params)

    def thought(ids, finish, at_string):
        text = decode(ids).split("otra")[0] if at_string else decode(ids)  # as the engine cuts it
        return RequestOutput(
            "q0", [5, 6, 90], ids, text, finish, None, 0.0, None, 0.0, stopped_at_string=at_string
        )

    def written(row, ids, text):
        answer = RequestOutput("q0", [], ids, text, "stop", None, 0.0, None, 0.0)
        got = row.result(0, answer)
        return got["reasoning"], got["generated_text"], got["num_generated_tokens"], got["error"]

    assert row._answer(thought([7, 40, 42], "stop", True)).prompt_ids == [5, 6, 90, 7, 40, 42]
    assert row._answer(thought([7, 40, 41], "stop", True)).prompt_ids == [5, 6, 90, 7, 40, 41]
    assert row._answer(thought([7, 8, 9], "length", False)).prompt_ids == [5, 6, 90, 7, 8, 9, 40, 41]
    # the model ended (its EOS, 2) while thinking: the answer follows the thought, not the EOS
    assert row._answer(thought([7, 8, 2], "stop", False)).prompt_ids == [5, 6, 90, 7, 8, 40, 41]
    # what is written: the text after the tag inside 'tral' begins the answer, which was asked after it
    free = reasoning_row(SamplingParams(max_new_tokens=4))
    free._answer(thought([7, 40, 42], "stop", True))
    assert written(free, [8], " yes") == ("hm", "l yes", 4, None)
    free._answer(thought([7, 40, 41], "stop", True))  # the tag's own tokens: nothing after it
    assert written(free, [8], " yes") == ("hm", " yes", 4, None)
    row._answer(thought([7, 40, 42], "stop", True))  # a label can't hold it: the row is an error naming it
    reasoning, text, _, error = written(row, [8], "yes")
    assert text is None and "'otra' ended inside a token" in error and "'l'" in error
    # a decoding that no longer holds the tag (it never should): the answer's start is unknown, an error
    free._answer(thought([7, 40, 42], "stop", True))
    free.decode = lambda ids: "".join(pieces[t] for t in ids if t != 41 and t != 42)
    assert "'otra' is not in its tokens' decoded text" in written(free, [8], " yes")[3]


def test_text_after_a_close_tag_that_ends_inside_a_token_begins_the_answer(data, tiny_model_dir, tmp_path):
    """The close tag 're ne' ends inside the token ' negative' the tiny model writes after 'gre': the rest of
    it, 'gative', begins the answer, as in the split of the one-request text (it was in neither column, the
    answer asked after it). Under --choices the answer can't hold it: that row is an error naming it."""
    prompt = ["--template", "{question}<t>", "--no-chat", "--reasoning-tags", "<t>,re ne"]
    one, two, labels = tmp_path / "one", tmp_path / "two", tmp_path / "labels"
    run(data, one, tiny_model_dir, *prompt, "--max-new-tokens", "10")
    run(data, two, tiny_model_dir, *prompt, "--max-reasoning-tokens", "6", "--max-new-tokens", "4")
    closed = [(a, b) for a, b in zip(rows(one), rows(two), strict=True) if a["generated_text"]]
    assert any(b["generated_text"].startswith("gative") for _, b in closed)  # the tag did end inside one
    for a, b in closed:  # the thinking closed: the same split, the answer cut shorter by --max-new-tokens
        assert b["reasoning"] == a["reasoning"] and b["generated_text"], (a, b)
        assert a["generated_text"].startswith(b["generated_text"]), (a, b)
    run(data, labels, tiny_model_dir, *prompt, "--max-reasoning-tokens", "6", "--choices", "a,b")
    for b, c in zip(rows(two), rows(labels), strict=True):
        if b["generated_text"].startswith("gative"):
            assert c["generated_text"] is None and c["finish_reason"] == "error", c
            assert "'re ne' ended inside a token" in c["error"] and "'gative'" in c["error"]
        else:
            assert c["generated_text"] in ("a", "b") and c["error"] is None, c


def test_samples_of_a_row_in_two_requests_keep_their_index(data, thinker, tmp_path):
    """--n with a bounded thinking: each sample's answer runs as its own request (sample 0 of it); the row's
    samples are 0..n-1, and the job exports (a part holding one key twice is refused as damaged)."""
    out = tmp_path / "out"
    run(data, out, thinker, "--n", "3", "--max-reasoning-tokens", "3", "--temperature", "1", "--seed", "1")
    got = rows(out)
    assert len(got) == 3 * 6
    for rid in {r["rid"] for r in got}:
        assert sorted(r["sample_index"] for r in got if r["rid"] == rid) == [0, 1, 2]
    result = CliRunner().invoke(main, ["export", str(out), "--format", "jsonl"])
    assert result.exit_code == 0, result.output


def test_the_openai_export_carries_the_thinking():
    from batchjob.job.export import _openai_choice

    row = {"generated_text": "yes", "finish_reason": "stop", "reasoning": "it says good", "sample_index": 1}
    assert _openai_choice(row, completions=False)["message"]["reasoning_content"] == "it says good"
    assert "reasoning_content" not in _openai_choice(row | {"reasoning": None}, completions=False)["message"]


def test_think_tags_in_the_conversation_are_its_text(thinker, tmp_path):
    """Only the prompt's end says whether the template opened the thinking or turned it off: a tag in a
    message (a question about the tag, an earlier turn's thinking) is text, and the row still thinks first."""
    from transformers import AutoTokenizer

    from batchjob.job.reasoning import find_tags

    tok = AutoTokenizer.from_pretrained(thinker)
    tags = find_tags(tok, None)

    def opened(messages, **kwargs):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return tags.opened(ids, tok.decode)

    user = {"role": "user", "content": "Is it positive?"}
    assert opened([user]) is None
    assert opened([user], enable_thinking=False) is False
    assert opened([{"role": "user", "content": "What does <think> mean?"}]) is None
    earlier = [user, {"role": "assistant", "content": "<think>\n\n</think>\n\nyes"}, user]
    assert opened(earlier) is None
    text = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False) + "<think>\n"
    assert tags.opened(tok(text, add_special_tokens=False)["input_ids"], tok.decode)
    # end to end: a question holding a closed block still thinks before its answer
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"rid": "q0", "question": "Think first, inside <think> </think>."}) + "\n")
    out = tmp_path / "out"
    run(path, out, thinker, "--choices", ",".join(LABELS), "--max-reasoning-tokens", "3")
    [r] = rows(out)
    assert r["reasoning"] is not None and r["generated_text"] in LABELS, r


def test_think_tags_that_are_special_tokens_are_refused(tiny_model_dir):
    """The thinking is told from the answer in the written text, which leaves special tokens out: tags that
    are special tokens would leave the thinking in the answer (or the answer in the reasoning column)."""
    from transformers import AutoTokenizer

    from batchjob.errors import ConfigError
    from batchjob.job.reasoning import find_tags

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<think>", "</think>"])
    assert find_tags(tok, None).open == "<think>"
    special = AutoTokenizer.from_pretrained(tiny_model_dir)
    special.add_tokens(["<think>", "</think>"], special_tokens=True)
    with pytest.raises(ConfigError, match="'<think>' is a special token of this tokenizer"):
        find_tags(special, None)
    with pytest.raises(ConfigError, match="'<\\|im_end\\|>' is a special token"):
        find_tags(tok, ("<think>", "<|im_end|>"))


def test_the_prompts_end_is_read_as_text_not_as_the_tags_own_tokens():
    """A tag that is no added token may be other tokens in context (Qwen2's and Llama 3's BPE spell '<think>'
    then a newline as '<think' and '>\\n'): matched by ids, a DeepSeek-R1-style template's open block was not
    seen, and the thinking landed in the answer."""
    from batchjob.job.reasoning import ReasoningTags

    tags = ReasoningTags("<think>", "</think>", (7, 8), (9, 7, 8))  # alone: '<think' '>', '</' '<think' '>'
    pieces = {
        1: "<｜User｜>hi",
        2: "<｜Assistant｜>",
        3: "<think",
        4: ">\n",
        5: "\n\n",
        6: "</think>\n\n",
        11: "ok",
    }

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert tags.opened([1, 2, 3, 4], decode) is True
    assert tags.opened([1, 2, 3, 4, 5, 6], decode) is False
    assert tags.opened([1, 2, 3, 4, 5, 6, 11], decode) is None
    assert tags.opened([1, 2], decode) is None
