"""A reasoning model's OpenAI requests (--format openai) in two requests, the thinking and then the answer:
both together stay within the body's max_tokens, as OpenAI counts reasoning tokens inside it."""

from __future__ import annotations

import json

import pytest

from tests.job.test_reasoning import rows, run, thinker  # noqa: F401 (thinker: the module's model fixture)
from tests.jobproc import sigterm_after_steps

pytestmark = pytest.mark.timeout(300)

QUESTIONS = ["Is review 0 positive?", "Is review 1 positive?", "Is review 2 positive?"]


def requests(path, **body):
    """A Batch file of one chat request per question, each with ``body``'s fields."""
    with open(path, "w") as f:
        for i, q in enumerate(QUESTIONS):
            line = {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": q}], **body},
            }
            f.write(json.dumps(line) + "\n")
    return path


def openai_run(data, out, model, *extra, code=0):
    """``run`` on a Batch file, its rows by request and sample."""
    run(data, out, model, *extra, code=code, prompts=("--format", "openai"))
    return sorted(rows_of(out), key=lambda r: (r["custom_id"], r.get("sample_index") or 0))


def rows_of(out):
    import pyarrow.dataset as ds

    return ds.dataset(out, format="parquet").to_table().to_pylist(maps_as_pydicts="strict")


def test_thinking_and_answer_share_max_tokens(thinker, tmp_path):  # noqa: F811
    """--max-reasoning-tokens 10 beside a body's max_tokens 4: the thinking stops at 4 and, having used them
    all, the answer is empty with finish_reason 'length' (was: 4 thinking tokens more, then 4 answer ones)."""
    data = requests(tmp_path / "r.jsonl", max_tokens=4, temperature=0, logprobs=True)
    for r in openai_run(data, tmp_path / "out", thinker, "--max-reasoning-tokens", "10"):
        assert r["num_generated_tokens"] == 4 and r["reasoning"] and r["error"] is None, r
        assert r["generated_text"] == "" and r["finish_reason"] == "length" and r["logprobs"] == [], r
    # a thinking bounded below max_tokens leaves the answer the rest: 2 and at most 3
    data = requests(tmp_path / "s.jsonl", max_completion_tokens=5, temperature=0)
    for r in openai_run(data, tmp_path / "out2", thinker, "--max-reasoning-tokens", "2"):
        assert r["reasoning"] is not None and 2 < r["num_generated_tokens"] <= 5 and r["error"] is None, r


def test_a_json_answer_the_thinking_left_no_room_for_is_an_error_naming_it(thinker, tmp_path):  # noqa: F811
    """response_format with max_tokens 4: the thinking uses them all, so the row is an error naming the
    limit and the thinking's share (was: a JSON answer of 4 tokens more, 8 written where the body allows 4)."""
    data = requests(
        tmp_path / "r.jsonl", max_tokens=4, temperature=0, response_format={"type": "json_object"}
    )
    for r in openai_run(data, tmp_path / "out", thinker):
        assert r["finish_reason"] == "error" and r["generated_text"] is None, r
        assert "max_tokens 4 counts the thinking's tokens and the answer's together" in r["error"], r
        assert "the thinking used 4" in r["error"], r
    # a thinking bounded at 3 leaves the answer 1 token, too few for JSON: the engine's error says the share
    for r in openai_run(data, tmp_path / "out2", thinker, "--max-reasoning-tokens", "3"):
        assert r["finish_reason"] == "error" and r["num_generated_tokens"] <= 4, r
        assert "(1 tokens, max_new_tokens 1)" in r["error"], r
        assert "the thinking used 3, leaving the answer 1" in r["error"], r


def test_samples_and_resume_keep_the_shared_limit(thinker, tmp_path):  # noqa: F811
    """--n samples each keep thinking and answer within max_tokens, and a job killed mid-thinking or
    mid-answer resumes to what an uninterrupted one writes (the answer's share comes from the saved thinking)."""
    data = requests(tmp_path / "r.jsonl", max_tokens=6, n=2, temperature=0.8)
    extra = ["--max-reasoning-tokens", "3", "--seed", "2"]
    want = openai_run(data, tmp_path / "want", thinker, *extra)
    assert len(want) == 2 * len(QUESTIONS)
    for r in want:
        assert r["reasoning"] is not None and r["num_generated_tokens"] <= 6, r
    for step, answering in ((2, []), (4, [0, 1])):  # killed in every sample's thinking, then in its answer
        out = tmp_path / f"out{step}"
        with sigterm_after_steps(step):
            openai_run(data, out, thinker, *extra, "--checkpoint-interval", "0.001", code=75)
        saved = json.loads((out / "_batchjob" / "inflight.json").read_text())["body"]["requests"]
        assert saved and all(r["kind"] == "reasoning" and r.get("answering", []) == answering for r in saved)
        assert openai_run(data, out, thinker, *extra) == want


def test_rows_jobs_keep_a_whole_max_new_tokens_for_the_answer(thinker, tmp_path):  # noqa: F811
    """Not an OpenAI job: the thinking runs to --max-reasoning-tokens and the answer gets --max-new-tokens
    on top, as documented."""
    data = tmp_path / "q.jsonl"
    data.write_text(
        "".join(json.dumps({"rid": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS))
    )
    run(data, tmp_path / "out", thinker, "--max-reasoning-tokens", "4", "--max-new-tokens", "3")
    assert any(r["num_generated_tokens"] > 4 for r in rows(tmp_path / "out"))
