"""``batchjob run`` with --choices, --json-schema, --regex, --logprobs and --n on a tiny random model: every
answer valid, the feature columns there, each (id, sample_index) once, resume exact, bad options exit 2."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jsonschema
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
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
    return ds.dataset(out, format="parquet").to_table().to_pylist(maps_as_pydicts="strict")


def test_choices_give_a_label_and_its_confidence(data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(*base(data, out, tiny_model_dir), "--id-column", "id", "--choices", ",".join(LABELS))
    assert code == 0, text
    result = rows(out)
    assert len(result) == 10
    for r in result:
        assert r["generated_text"] in LABELS and r["finish_reason"] == "stop"
        lp = r["choice_logprobs"]  # an Arrow map: {label: log-prob}, in the labels' order
        assert set(lp) == set(LABELS) and all(math.isfinite(v) and v < 0 for v in lp.values())
        assert r["generated_text"] == max(lp, key=lp.get)  # greedy: the most likely label
        probs = r["choice_probs"]  # the same, renormalised over the labels: a readable confidence
        assert list(probs) == list(lp) and sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
        total = sum(math.exp(v) for v in lp.values())
        assert all(probs[k] == pytest.approx(math.exp(lp[k]) / total, rel=1e-9) for k in LABELS)
        assert max(probs, key=probs.get) == r["generated_text"]
    assert "sample_index" not in result[0] and "logprobs" not in result[0]
    # queryable as Arrow: a map from label to value, in the labels' order
    table = ds.dataset(out, format="parquet").to_table()
    for column in ("choice_probs", "choice_logprobs"):
        assert table.schema.field(column).type == pa.map_(pa.string(), pa.float64())
    assert all(list(r["choice_probs"]) == LABELS for r in result)
    first = pc.map_lookup(table.column("choice_probs"), LABELS[0], "first").to_pylist()
    assert first == [r["choice_probs"][LABELS[0]] for r in result]


def test_choices_repeated_are_one_label_set(data, tiny_model_dir, tmp_path):
    """--choices given more than once joins the labels, as --stop's repeats are joined: Click kept the last
    one alone, and every row was answered from it (choice_probs {'d': 1.0}) without a word."""
    split = ["--choices", LABELS[0], "--choices", ",".join(LABELS[1:])]
    for out, labels in ((tmp_path / "one", ["--choices", ",".join(LABELS)]), (tmp_path / "split", split)):
        code, text = invoke(*base(data, out, tiny_model_dir), "--id-column", "id", *labels)
        assert code == 0, text
    got = rows(tmp_path / "split")
    assert all(list(r["choice_probs"]) == LABELS for r in got)
    key = ("id", "generated_text", "choice_logprobs")
    assert [[r[k] for k in key] for r in got] == [[r[k] for k in key] for r in rows(tmp_path / "one")]


def test_a_choices_job_an_earlier_batchjob_answered_otherwise_is_not_resumed(data, tiny_model_dir, tmp_path):
    """Labels one of which another goes on from ('no' and 'no thanks') are read whole since 2026-12-07 (the
    pick, and a label a longer one continues, changed): a job an earlier batchjob started mixed both
    readings of one prompt in one output ('ac!' and 'b'). Its identity says so; an earlier one is refused."""
    from batchjob.io.atomic import read_json, write_json

    out = tmp_path / "out"
    args = [*base(data, out, tiny_model_dir), "--id-column", "id", "--choices", "no,no thanks,yes"]
    assert invoke(*args)[0] == 0
    saved = read_json(out / "_batchjob" / "job.json")
    del saved["fingerprint"]["sampling"]["choice_scoring"]  # as an earlier batchjob recorded it
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke(*args)
    assert code == 2 and "sampling.choice_scoring: was None, now 'whole labels'" in text, text


@pytest.mark.parametrize("earlier", [None, "whole labels"])
def test_a_sampled_choices_job_an_earlier_batchjob_started_is_not_resumed(
    data, tiny_model_dir, tmp_path, earlier
):
    """A sampled label is drawn from the whole labels' probabilities since 2026-12-07 (it was the token
    walk's: 'ab' beside 'c' came 289 of 400 times at a probability of 1e-5): a sampled --choices job an earlier
    batchjob started, which recorded no marker or 'whole labels', would mix both draws in one output."""
    from batchjob.io.atomic import read_json, write_json

    out = tmp_path / "out"
    labels = "no,no thanks,yes" if earlier else "no,yes"
    args = [*base(data, out, tiny_model_dir), "--id-column", "id", "--choices", labels, "--temperature", "1"]
    assert invoke(*args)[0] == 0
    saved = read_json(out / "_batchjob" / "job.json")
    saved["fingerprint"]["sampling"]["choice_scoring"] = earlier  # as an earlier batchjob recorded it
    if earlier is None:
        del saved["fingerprint"]["sampling"]["choice_scoring"]
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke(*args)
    assert (
        code == 2 and f"sampling.choice_scoring: was {earlier!r}, now 'whole labels, sampled too'" in text
    ), text
    greedy = tmp_path / "greedy"  # a greedy job keeps its identity
    args = [*base(data, greedy, tiny_model_dir), "--id-column", "id", "--choices", "no,yes"]
    assert invoke(*args)[0] == 0
    assert "choice_scoring" not in read_json(greedy / "_batchjob" / "job.json")["fingerprint"]["sampling"]


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
    got = [(r["generated_text"], r["finish_reason"], r["error"]) for r in rows(out2)]
    assert all(text is not None and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text) for text, _, _ in got), got


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
    generated = sum(r["num_generated_tokens"] for r in result)
    # counts say which they are: 10 input rows, 30 samples; each prompt's tokens counted once
    assert (
        f"complete: 10 of 10 rows done (0 errors); this run: 10 rows (30 samples), {generated} tokens" in text
    )
    prompt_tokens = sum(r["num_prompt_tokens"] for r in result if r["sample_index"] == 0)
    for r in result:
        lp = r["logprobs"]  # a struct per generated token: the sampled token, its log-prob, the top 2
        assert len(lp) == r["num_generated_tokens"]
        for t in lp:
            assert [x["logprob"] for x in t["top_logprobs"]] == sorted(
                (x["logprob"] for x in t["top_logprobs"]), reverse=True
            )
            assert len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 and isinstance(t["token"], str)
            if t["token_id"] in [x["token_id"] for x in t["top_logprobs"]]:
                assert t["logprob"] == next(
                    x["logprob"] for x in t["top_logprobs"] if x["token_id"] == t["token_id"]
                )
            else:
                assert t["logprob"] <= t["top_logprobs"][-1]["logprob"]
    texts = {}
    for r in result:
        texts.setdefault(r["id"], set()).add(r["generated_text"])
    assert any(len(t) > 1 for t in texts.values())  # the samples differ
    code, text = invoke("status", out)
    assert code == 0 and "rows: 10 of 10 input rows (100.0%)" in text, text
    assert "samples: 30 result rows (3 a row)" in text and "errors: 0 rows" in text
    assert f"tokens: {prompt_tokens} in, {generated} out" in text
    assert "last run: 10 rows (30 samples) in" in text


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
                    assert a == pytest.approx(b, abs=1e-4)
            assert g == e


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "0"], "n must be"),
        (["--logprobs", "-1"], "takes a whole number 0 or more"),
        (["--json-schema", "/no/such/schema.json"], "cannot be read"),
        (["--choices", "a,b", "--regex", "x"], "exclude each other"),
        (["--choices", "a,a"], "distinct"),
        (["--regex", "(unclosed"], "regex could not be compiled"),
        (["--regex", "[[:alpha:]]{3}"], "reads differently in llguidance"),
        (["--regex", r"\w+"], "the class \\w at position 0"),
    ],
)
def test_bad_constraint_options_exit_2(data, tiny_model_dir, tmp_path, extra, message):
    code, text = invoke(*base(data, tmp_path / "out", tiny_model_dir), *extra)
    assert code == 2 and message in text, text
    assert "Traceback" not in text


def test_a_label_holding_a_special_token_is_refused_before_work(data, tiny_model_dir, tmp_path):
    """validate said ok and the label was scored as the token itself (the end of the answer, for the EOS
    text), not as its text; a params column's label is that row's error."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token
    out = tmp_path / "out"
    for command in ("validate", "run"):
        code, text = invoke(command, *base(data, out, tiny_model_dir)[1:], "--choices", f"yes,no,{end}")
        assert code == 2 and f"--choices: the choice {end!r} holds the special token {end!r}" in text, text
        assert "spell the label without it" in text and "Traceback" not in text
    assert not out.exists() or not list(out.glob("part-*"))
    per_row = tmp_path / "rows.jsonl"
    labels = [["yes", f"yes{end}"], ["yes", "no"]]
    per_row.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "review": "ok", "p": {"choices": c}}) + "\n"
            for i, c in enumerate(labels)
        )
    )
    args = ["--id-column", "id", "--params-column", "p"]
    code, text = invoke(*base(per_row, out, tiny_model_dir), *args)
    assert code == 0, text
    bad, good = sorted(rows(out), key=lambda r: r["id"])
    assert bad["error"] == (
        f"the choice 'yes{end}' holds the special token {end!r}, which the output text leaves out: it would be "
        "scored as that token (the end of the answer, for an end-of-sequence token), not as its text; spell "
        "the label without it"
    )
    assert good["error"] is None and good["generated_text"] in ("yes", "no")


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


def test_a_job_with_json_text_choice_columns_is_refused_not_mixed(data, tiny_model_dir, tmp_path):
    """A job started by an earlier batchjob wrote choice_probs/choice_logprobs as JSON text: resuming it must
    not add parts of another schema (a dataset of both can't be read as one); it is refused, naming the
    column and the part, and `export` still reads it."""
    from batchjob.job.manifest import Manifest

    out = tmp_path / "out"
    args = [*base(data, out, tiny_model_dir), "--choices", ",".join(LABELS), "--max-num-seqs", "2"]
    with sigterm_after_steps(12):
        code, text = invoke(*args, "--checkpoint-interval", "0.001")
    assert code == 75, text
    manifest = Manifest(out / "_batchjob" / "manifest.jsonl")
    assert manifest.parts
    records = []
    for record in manifest.parts:  # the parts as the earlier version wrote them: JSON text
        path = out / record.name
        table = pq.read_table(path)
        for column in ("choice_probs", "choice_logprobs"):
            text_values = [
                None if v is None else json.dumps(dict(v)) for v in table.column(column).to_pylist()
            ]
            i = table.schema.get_field_index(column)
            table = table.set_column(i, pa.field(column, pa.string()), pa.array(text_values, pa.string()))
        pq.write_table(table, path)
        # as the earlier version recorded them: no digest or stamps (those came with the same release)
        records.append(
            dataclasses.replace(record, size=path.stat().st_size, sha256=None, ino=None, ctime_ns=None)
        )
    manifest.rewrite(records)
    code, text = invoke(*args)
    assert code == 2, text
    assert "its parts were written by an earlier batchjob with other column types" in text
    assert "choice_logprobs is string there, map<string, double> now" in text and records[0].name in text
    assert "run it into a new --output folder" in text and "Traceback" not in text
    assert Manifest(out / "_batchjob" / "manifest.jsonl").parts == records  # nothing added
    code, text = invoke("export", out, "--to", tmp_path / "old.jsonl")
    assert code == 0, text


@pytest.mark.engine
def test_choices_logprobs_are_the_answers_own(tmp_path):
    """Greedy answers 'bc!' (0.3) where the token walk took 'a' (0.5, then 'c' 0.5): the logprobs column
    held the walk's two entries for the answer's three tokens, 'c' read P('c' | 'a') = -0.69 with 'a''s top
    tokens, and the OpenAI export the same. Now one per answer token, each at its own place in the answer."""
    from tests.tiny_models import make_choice_bigram  # (a model built only here)

    make_choice_bigram(tmp_path / "m", 0.5)
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "r", "prompt": "x"}\n')
    out = tmp_path / "out"
    args = ["--id-column", "id", "--no-chat", "--dtype", "float64", "--choices", "ac,bc!", "--logprobs", "2"]
    code, text = invoke("run", "--input", data, "--output", out, "--model", tmp_path / "m", *args)
    assert code == 0, text
    [r] = rows(out)
    assert r["generated_text"] == "bc!" and r["num_generated_tokens"] == 3
    assert [t["token"] for t in r["logprobs"]] == ["b", "c", "!"]
    assert [t["logprob"] for t in r["logprobs"]] == pytest.approx([math.log(0.3), 0, 0], abs=1e-5)
    assert [t["top_logprobs"][0]["token"] for t in r["logprobs"]] == ["a", "c", "!"]
    code, text = invoke("export", out, "--format", "openai")
    assert code == 0, text
    [line] = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    body = line["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["b", "c", "!"]
