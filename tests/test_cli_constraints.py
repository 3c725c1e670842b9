"""``batchjob run`` with --choices, --json-schema, --regex, --logprobs and --n on a tiny random model: every
answer valid, the feature columns there, each (id, sample_index) once, resume exact, bad options exit 2."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from tests.jobproc import sigterm_after_steps

pytestmark = pytest.mark.timeout(120)

LABELS = ["positive", "negative", "neutral", "not sure"]
SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative"]},
        "summary": {"type": "string"},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "summary", "stars"],
}


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i in range(10):
            f.write(
                json.dumps({"id": f"r{i}", "review": f"great product {i}, would buy {i % 3} again"}) + "\n"
            )
    return path


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def base(data, out, model):
    return ["run", "--input", data, "--output", out, "--model", model, "--template", "Review: {review}"]


def rows(out):
    return ds.dataset(out, format="parquet").to_table().to_pylist()


def test_choices_give_a_label_and_its_confidence(data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(*base(data, out, tiny_model_dir), "--id-column", "id", "--choices", ",".join(LABELS))
    assert code == 0, text
    result = rows(out)
    assert len(result) == 10
    for r in result:
        assert r["generated_text"] in LABELS and r["finish_reason"] == "stop"
        lp = json.loads(r["choice_logprobs"])
        assert set(lp) == set(LABELS) and all(math.isfinite(v) and v < 0 for v in lp.values())
        assert r["generated_text"] == max(lp, key=lp.get)  # greedy: the most likely label
        probs = json.loads(r["choice_probs"])  # the same, renormalised over the labels: a readable confidence
        assert list(probs) == list(lp) and sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
        total = sum(math.exp(v) for v in lp.values())
        assert all(probs[k] == pytest.approx(math.exp(lp[k]) / total, rel=1e-9) for k in LABELS)
        assert max(probs, key=probs.get) == r["generated_text"]
    assert "sample_index" not in result[0] and "logprobs" not in result[0]


def test_json_schema_and_regex_answers_are_valid(data, tiny_model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "out"
    code, text = invoke(*base(data, out, tiny_model_dir), "--json-schema", schema, "--max-new-tokens", "40")
    assert code == 0, text
    for r in rows(out):
        jsonschema.validate(json.loads(r["generated_text"]), SCHEMA)
    out2 = tmp_path / "out2"
    code, text = invoke(
        *base(data, out2, tiny_model_dir), "--regex", r"[A-Z]{2}-[0-9]{3}", "--temperature", "1"
    )
    assert code == 0, text
    assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r["generated_text"]) for r in rows(out2))


def test_n_samples_with_logprobs(data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = [
        *base(data, out, tiny_model_dir),
        "--id-column",
        "id",
        "--n",
        "3",
        "--temperature",
        "1",
        "--seed",
        "5",
    ]
    code, text = invoke(*args, "--logprobs", "2", "--max-new-tokens", "6")
    assert code == 0, text
    result = rows(out)
    assert sorted((r["id"], r["sample_index"]) for r in result) == [
        (f"r{i}", k) for i in range(10) for k in range(3)
    ]
    for r in result:
        lp = json.loads(r["logprobs"])
        assert len(lp) == r["num_generated_tokens"]
        assert all(2 <= len(top) <= 3 and all(v <= 0 for _, v in top) for top in lp)
    texts = {}
    for r in result:
        texts.setdefault(r["id"], set()).add(r["generated_text"])
    assert any(len(t) > 1 for t in texts.values())  # the samples differ
    code, text = invoke("status", out)
    assert code == 0 and "rows: 10 of 10" in text


def test_interrupted_n_and_choices_jobs_resume_exactly(data, tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM after a few engine steps (state saved, exit 75), rerun: equal to an uninterrupted run."""

    for extra in (
        ["--choices", ",".join(LABELS), "--n", "2", "--temperature", "1"],
        ["--n", "3", "--temperature", "1"],
    ):
        args = [*extra, "--id-column", "id", "--seed", "3", "--max-new-tokens", "8", "--max-num-seqs", "3"]
        want = tmp_path / f"want{len(extra)}"
        assert invoke(*base(data, want, tiny_model_dir), *args)[0] == 0
        out = tmp_path / f"out{len(extra)}"
        with sigterm_after_steps(4):
            code, text = invoke(*base(data, out, tiny_model_dir), *args)
        assert code == 75, text
        saved = [json.loads(f.read_text()) for f in (out / "_batchjob").rglob("*inflight*.json")]
        assert any("samples" in json.dumps(body) for body in saved)  # samples were checkpointed mid-way
        code, text = invoke(*base(data, out, tiny_model_dir), *args)
        assert code == 0, text

        def key(r):
            return (r["id"], r.get("sample_index", 0))

        got, expected = sorted(rows(out), key=key), sorted(rows(want), key=key)
        assert [key(r) for r in got] == [key(r) for r in expected]  # each (id, sample_index) exactly once
        for g, e in zip(got, expected, strict=True):
            for column in ("choice_logprobs", "choice_probs"):
                a, b = g.pop(column, None), e.pop(column, None)
                if b is not None:  # float sums, batched differently: equal to rounding
                    assert json.loads(a) == pytest.approx(json.loads(b), abs=1e-4)
            assert g == e


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "0"], "n must be"),
        (["--logprobs", "-1"], "logprobs must be"),
        (["--json-schema", "/no/such/schema.json"], "cannot be read"),
        (["--choices", "a,b", "--regex", "x"], "exclude each other"),
        (["--choices", "a,a"], "distinct"),
        (["--regex", "(unclosed"], "regex could not be compiled"),
    ],
)
def test_bad_constraint_options_exit_2(data, tiny_model_dir, tmp_path, extra, message):
    code, text = invoke(*base(data, tmp_path / "out", tiny_model_dir), *extra)
    assert code == 2 and message in text, text
    assert "Traceback" not in text


def test_a_schema_it_cannot_compile_exits_2_before_any_work(data, tiny_model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    code, text = invoke(*base(data, tmp_path / "out", tiny_model_dir), "--json-schema", schema)
    assert code == 2 and "uniqueItems" in text
    schema.write_text("{not json")
    code, text = invoke(*base(data, tmp_path / "out", tiny_model_dir), "--json-schema", schema)
    assert code == 2 and "not valid JSON" in text
    assert not (tmp_path / "out").exists()


def test_a_resume_with_another_label_set_is_refused(data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    assert invoke(*base(data, out, tiny_model_dir), "--choices", "yes,no", "--max-new-tokens", "2")[0] == 0
    code, text = invoke(
        *base(data, out, tiny_model_dir), "--choices", "yes,no,maybe", "--max-new-tokens", "2"
    )
    assert code == 2 and "choices" in text
