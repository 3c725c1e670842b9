"""``batchjob export``: results in input order (by file, then row) as JSONL, CSV or OpenAI Batch output lines."""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job import make_spec, run_job
from batchjob.job.shard import Shard

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two JSONL files and a Parquet file: 25 + 1 (a torn line) + 12 + 9 rows."""
    folder = tmp_path_factory.mktemp("in")
    with open(folder / "a.jsonl", "w") as f:
        for i in range(25):
            f.write(json.dumps({"rid": f"a{i:02d}", "text": f"first file row {i}"}) + "\n")
        f.write("{torn\n")
    with open(folder / "b.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"rid": f"b{i:02d}", "text": f"second file row {i}"}) + "\n")
    rows = {"rid": [f"c{i:02d}" for i in range(9)], "text": [f"parquet row {i}" for i in range(9)]}
    pq.write_table(pa.table(rows), folder / "c.parquet")
    return folder


def run(inputs, out, shards=1, **kw):
    spec = make_spec(
        input=[str(inputs)],
        output=str(out),
        model=kw.pop("model"),
        id_column="rid",
        max_new_tokens=3,
        max_num_seqs=3,
        chat=False,
        checkpoint_interval=1e-6,  # a part every step: many small parts to merge
        **kw,
    )
    for i in range(shards):
        assert run_job(spec, shard=Shard(i, shards)).status == "complete"


def export(out, fmt, *extra):
    result = CliRunner().invoke(main, ["export", str(out), "--format", fmt, *extra])
    assert result.exit_code == 0, result.output
    return result.stdout if hasattr(result, "stdout") else result.output


def expected_order():
    return (
        [f"a{i:02d}" for i in range(25)]
        + [None]
        + [f"b{i:02d}" for i in range(12)]
        + [f"c{i:02d}" for i in range(9)]
    )


def _strict(line):
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_infinity_export_as_null_in_standard_json(tiny_model_dir, tmp_path):
    """Python's json writes a bare NaN, which strict readers refuse and jq reads as null: null, said once."""
    data = tmp_path / "in"
    data.mkdir()
    table = {"rid": ["x", "y", "z"], "text": ["one", "two", "three"], "v": [float("nan"), float("-inf"), 1.5]}
    pq.write_table(pa.table(table | {"vs": [[float("inf"), 2.0], [], None]}), data / "t.parquet")
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    result = CliRunner().invoke(main, ["export", str(out), "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    rows = [_strict(line) for line in result.stdout.splitlines()]
    assert [(r["v"], r["vs"]) for r in rows] == [(None, [None, 2.0]), (None, []), (1.5, None)]
    assert "3 NaN or infinite values written as null" in result.stderr


@pytest.mark.process
def test_export_into_a_pipe_its_reader_closes_says_nothing(tiny_model_dir, tmp_path):
    """`batchjob export OUT | head -1`: the reader had what it wanted; no 'Error: Broken pipe'."""
    import subprocess
    import sys

    data = tmp_path / "in"
    data.mkdir()
    pq.write_table(
        pa.table({"rid": [f"r{i}" for i in range(200)], "text": ["x" * 1000] * 200}), data / "t.parquet"
    )
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    command = [sys.executable, "-m", "batchjob", "export", str(out), "--format", "jsonl"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b'{"rid": "r0"')
    proc.stdout.close()  # 200 KB of lines, more than the pipe holds: the next write finds no reader
    assert proc.wait(timeout=120) == 1 and proc.stderr is not None and proc.stderr.read() == b""


@pytest.mark.parametrize("shards", [1, 3])
def test_jsonl_and_csv_are_in_input_order(inputs, tiny_model_dir, tmp_path, shards):
    out = tmp_path / "out"
    run(inputs, out, shards, model=str(tiny_model_dir))
    assert len(list(out.glob("*.parquet"))) > 3  # several parts, from several workers: a real merge
    lines = export(out, "jsonl").splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["rid"] for r in rows] == expected_order()
    table = ds.dataset(out, format="parquet").to_table().to_pylist()
    by_id = {r["rid"]: r for r in table if r["rid"]}
    assert all(r == by_id[r["rid"]] for r in rows if r["rid"])  # the same values as the parts hold
    assert "bad JSON" in rows[25]["error"]

    target = tmp_path / "out.csv"
    CliRunner().invoke(main, ["export", str(out), "--format", "csv", "--to", str(target)])
    got = list(csv.DictReader(io.StringIO(target.read_text())))
    assert [r["rid"] or None for r in got] == expected_order()
    assert got[0]["generated_text"] == by_id["a00"]["generated_text"]
    assert list(got[0]) == list(table[0])  # the columns of the parts, in their order


def test_binary_dates_and_decimals_export_as_json_can_read_them(tiny_model_dir, tmp_path):
    """A binary column (an image job's pictures, say) in base64, not its Python repr; dates in ISO 8601."""
    import base64
    import datetime
    import decimal

    data = tmp_path / "in"
    data.mkdir()
    blob = bytes(range(256))
    table = {
        "rid": ["x", "y"],
        "text": ["one", "two"],
        "blob": pa.array([blob, None], pa.binary()),
        "day": pa.array([datetime.date(2026, 12, 7), None]),
        "price": pa.array([decimal.Decimal("1.50"), None], pa.decimal128(5, 2)),
        "meta": pa.array([{"raw": b"\x00\xff"}, None]),
        "at": pa.array([1_796_639_400_000_000_001, None], pa.timestamp("ns")),
        "took": pa.array([1_500_000_000, None], pa.duration("ns")),
    }
    pq.write_table(pa.table(table), data / "t.parquet")
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    rows = [json.loads(line) for line in export(out, "jsonl").splitlines()]
    assert [r["rid"] for r in rows] == ["x", "y"]
    assert base64.b64decode(rows[0]["blob"]) == blob and rows[1]["blob"] is None
    assert (rows[0]["day"], rows[0]["price"], rows[0]["meta"]) == ("2026-12-07", "1.50", {"raw": "AP8="})
    target = tmp_path / "out.csv"
    CliRunner().invoke(main, ["export", str(out), "--format", "csv", "--to", str(target)])
    got = list(csv.DictReader(io.StringIO(target.read_text())))
    assert base64.b64decode(got[0]["blob"]) == blob and json.loads(got[0]["meta"]) == {"raw": "AP8="}
    # csv's scalar dates, times and durations in ISO 8601 too, as jsonl's (not Python's or pandas' text)
    assert (got[0]["day"], got[0]["at"], got[0]["took"]) == (rows[0]["day"], rows[0]["at"], rows[0]["took"])
    assert got[0]["at"] == "2026-12-07T10:30:00.000000001" and got[0]["took"] == "P0DT0H0M1.5S"


def test_durations_export_in_iso_8601_with_one_sign(tiny_model_dir, tmp_path):
    """A duration[us] (or [s], [ms]) column came out as Python's str(): -1 s as '-1 day, 23:59:59', 2 days 5 s
    as '2 days, 0:00:05', in jsonl and csv. Every unit now writes ISO 8601, a negative one signed once."""
    import pandas as pd

    data = tmp_path / "in"
    data.mkdir()
    seconds = [-1, 2 * 86_400 + 5, 1.5, 0, -90_061.25]  # the last: -(1 day 1 h 1 min 1.25 s)
    expected = ["-P0DT0H0M1S", "P2DT0H0M5S", "P0DT0H0M1.5S", "P0DT0H0M0S", "-P1DT1H1M1.25S"]
    table = {"rid": [f"r{i}" for i in range(5)], "text": ["hi"] * 5}
    for unit, per_second in (("ms", 10**3), ("us", 10**6), ("ns", 10**9)):
        table[unit] = pa.array([round(s * per_second) for s in seconds], pa.duration(unit))
    table["ns"] = pa.array([*table["ns"].to_pylist()[:4], -1], pa.duration("ns"))  # one nanosecond back
    pq.write_table(pa.table(table), data / "t.parquet")
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    rows = [json.loads(line) for line in export(out, "jsonl").splitlines()]
    assert [r["ms"] for r in rows] == [r["us"] for r in rows] == expected
    assert [r["ns"] for r in rows] == [*expected[:4], "-P0DT0H0M0.000000001S"]
    got = list(csv.DictReader(io.StringIO(export(out, "csv"))))
    assert [r["us"] for r in got] == expected and [r["ns"] for r in got] == [r["ns"] for r in rows]
    assert [pd.Timedelta(x).total_seconds() for x in expected] == seconds  # pandas reads them back


def test_a_map_that_holds_a_key_twice_exports_every_entry(tiny_model_dir, tmp_path):
    """An input map may hold a key twice (Arrow's can); as a JSON object one entry was dropped, with a
    pyarrow warning only: such a row's maps are lists of [key, value] pairs, said on stderr."""
    data = tmp_path / "in"
    data.mkdir()
    maps = pa.array([[("k", 0), ("k", 1)], [("a", 2)]], pa.map_(pa.string(), pa.int64()))
    pq.write_table(pa.table({"rid": ["x", "y"], "text": ["one", "two"], "m": maps}), data / "t.parquet")
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    result = CliRunner().invoke(main, ["export", str(out), "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["m"] for r in rows] == [[["k", 0], ["k", 1]], {"a": 2}]
    assert "row 0: a map holds a key twice" in result.stderr


def test_openai_output_one_line_per_request_with_its_samples(inputs, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    run(inputs, out, model=str(tiny_model_dir), n=2, temperature=1.0, seed=3)
    lines = [json.loads(line) for line in export(out, "openai").splitlines() if line.startswith("{")]
    assert len(lines) == 25 + 1 + 12 + 9  # one per input row, its two samples as two choices
    ids = [line["custom_id"] for line in lines]
    assert ids[:25] == [f"a{i:02d}" for i in range(25)] and ids[25] == "a.jsonl:25"
    bad = lines[25]
    assert "bad JSON" in bad["error"]["message"]
    assert bad["response"]["status_code"] == 400  # a bad request, as OpenAI and vLLM write it
    assert bad["response"]["body"]["error"]["message"] == bad["error"]["message"]
    table = ds.dataset(out, format="parquet").to_table().to_pylist()
    for line in lines[:25] + lines[26:]:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion" and len(body["choices"]) == 2
        samples = sorted((r for r in table if r["rid"] == line["custom_id"]), key=lambda r: r["sample_index"])
        assert [c["message"]["content"] for c in body["choices"]] == [r["generated_text"] for r in samples]
        assert [c["index"] for c in body["choices"]] == [0, 1]
        usage = body["usage"]
        assert usage["completion_tokens"] == sum(r["num_generated_tokens"] for r in samples)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        _check_with_openai_types(body)


def test_a_rows_jobs_custom_id_and_url_columns_are_data_not_the_requests_own(tiny_model_dir, tmp_path):
    """A rows job's input columns named custom_id and url were read as an OpenAI request's: three rows exported
    with custom_id 'same' (and one response id, so they could not be joined back), a row whose custom_id was
    null got its file place instead of its --id-column value, and a url ending /v1/completions made a chat
    job's responses text completions. The custom_id is the row id, as docs/jobs.md says."""
    data = tmp_path / "in"
    data.mkdir()
    url = "https://shop.example/v1/completions"
    ids = [("r0", "same"), ("r1", "same"), ("r2", "same"), ("r3", None), (None, "given")]
    rows = [{"rid": rid, "custom_id": cid, "url": url, "text": "Paris is the capital"} for rid, cid in ids]
    (data / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    lines = [json.loads(x) for x in export(out, "openai").splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2", "r3", "t.jsonl:4"]  # the row ids
    assert len({x["id"] for x in lines}) == 5
    assert {x["response"]["body"]["object"] for x in lines[:4]} == {"chat.completion"}
    assert "id column 'rid' is null" in lines[4]["error"]["message"]  # a row without an id is an error row


def _check_with_openai_types(body):
    """Parse with the openai package's own types where it is installed; else check the fields by hand."""
    try:
        from openai.types.chat import ChatCompletion
    except ImportError:
        assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
        for c in body["choices"]:
            assert c["finish_reason"] in ("stop", "length") and c["message"]["role"] == "assistant"
        return
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == body["choices"][0]["message"]["content"]


def test_export_refuses_a_damaged_output_and_names_the_part(inputs, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    run(inputs, out, model=str(tiny_model_dir))
    part = sorted(out.glob("part-*.parquet"))[1]
    part.unlink()
    result = CliRunner().invoke(main, ["export", str(out), "--format", "jsonl"])
    assert result.exit_code == 1 and part.name in result.output and "batchjob run" in result.output


def flip_a_byte(path, at=None):
    """Damage a part as a bad disk or a stray write would: one byte changed, size and footer intact."""
    data = bytearray(path.read_bytes())
    at = len(data) // 3 if at is None else at
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_damaged_part_gets_one_verdict_from_every_command(inputs, tiny_model_dir, tmp_path):
    """A byte flipped inside a part (size and footer intact) and a truncated part: status, export, report and
    run all name them and say how to go on, and run redoes exactly their rows."""
    out = tmp_path / "out"
    run(inputs, out, model=str(tiny_model_dir))
    before = export(out, "jsonl")
    flipped, cut = sorted(out.glob("part-*.parquet"))[1:3]
    flip_a_byte(flipped)
    cut.write_bytes(cut.read_bytes()[:-100])

    def invoke(*argv):
        return CliRunner().invoke(main, [str(a) for a in argv])

    status = invoke("status", out)
    assert status.exit_code == 0 and "incomplete" in status.output, status.output
    assert f"missing or damaged: {flipped.name} is damaged" in status.output
    assert f"missing or damaged: {cut.name} has " in status.output and "batchjob run" in status.output
    exported = invoke("export", out)
    assert exported.exit_code == 1 and "Traceback" not in exported.output
    assert flipped.name in exported.output and cut.name in exported.output
    assert "`batchjob run` with the same command" in exported.output
    report = invoke("report", out, "--to", tmp_path / "report.html")
    assert report.exit_code == 0, report.output
    assert f"not drawn: {flipped.name} is damaged" in report.output and cut.name in report.output
    assert flipped.name in (tmp_path / "report.html").read_text()
    # run takes the same verdict: not "already complete"; it redoes those rows, and only those
    spec = make_spec(
        input=[str(inputs)],
        output=str(out),
        model=str(tiny_model_dir),
        id_column="rid",
        max_new_tokens=3,
        max_num_seqs=3,
        chat=False,
        checkpoint_interval=1e-6,
    )
    result = run_job(spec)
    assert result.status == "complete" and result.stats["rows"] > 0
    assert result.stats["rows"] < 25 + 1 + 12 + 9  # only the damaged parts' rows
    assert export(out, "jsonl") == before
    assert run_job(spec).status == "already complete"


def test_outputs_never_land_on_the_jobs_own_files(inputs, tiny_model_dir, tmp_path):
    """export --to, report --to and bench --json refuse a job's parts, state, folder and inputs, by name and
    through symbolic links, before writing anything; elsewhere (and where --input does not look) they write."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(inputs, data)
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    part = sorted(out.glob("part-*.parquet"))[0]
    manifest = out / "_batchjob" / "manifest.jsonl"
    (tmp_path / "to_part").symlink_to(part)
    (tmp_path / "to_out").symlink_to(out, target_is_directory=True)
    owned = {
        part: "inside the batchjob output folder",
        manifest: "the state of the batchjob output folder",
        out / "results.jsonl": "inside the batchjob output folder",  # pyarrow.dataset would read it too
        tmp_path / "to_part": "inside the batchjob output folder",
        tmp_path / "to_out" / "_batchjob" / "job.json": "the state of",
        data / "a.jsonl": "an input of the job",
        data / "new.jsonl": "where the job in",  # the next --append would take it in
    }
    saved = {p: p.read_bytes() for p in [part, manifest, data / "a.jsonl"]}
    for target, why in owned.items():
        for argv in (["export", out, "--to", target], ["report", out, "--to", target]):
            result = CliRunner().invoke(main, [str(a) for a in argv])
            assert result.exit_code == 2, (argv, result.output)
            assert f"--to {target} is" in result.output and why in result.output, result.output
    for task in ("generate", "score"):  # (a task's bench wrote it, before its own work)
        result = CliRunner().invoke(main, ["bench", "--task", task, "--json", str(manifest)])
        assert result.exit_code == 2 and f"--json {manifest} is the state of" in result.output, result.output
    assert {p: p.read_bytes() for p in saved} == saved and not (data / "new.jsonl").exists()
    assert CliRunner().invoke(main, ["status", str(out)]).exit_code == 0
    nested = out / "_batchjob" / "again"  # nor a job inside a job's folder
    result = CliRunner().invoke(main, ["run", "--input", str(data), "--output", str(nested)])
    assert (
        result.exit_code == 2 and f"--output {nested} is inside the batchjob output folder" in result.output
    )
    assert not nested.exists()
    for fine in (tmp_path / "results.jsonl", data / "_results.jsonl"):  # not inputs by discovery's rule
        result = CliRunner().invoke(main, ["export", str(out), "--to", str(fine)])
        assert result.exit_code == 0 and fine.read_text().count("\n") == 47, result.output


def test_a_copied_output_folder_is_read_whole_once_then_trusted_by_its_stamps(
    inputs, tiny_model_dir, tmp_path
):
    import shutil

    from batchjob.job.manifest import Manifest

    first = tmp_path / "first"
    run(inputs, first, model=str(tiny_model_dir))
    out = tmp_path / "copy"
    shutil.copytree(first, out)  # new inodes: each part is read whole and found as committed
    status = CliRunner().invoke(main, ["status", str(out)])
    assert status.exit_code == 0 and "complete" in status.output and "damaged" not in status.output
    spec = make_spec(
        input=[str(inputs)],
        output=str(out),
        model=str(tiny_model_dir),
        id_column="rid",
        max_new_tokens=3,
        max_num_seqs=3,
        chat=False,
        checkpoint_interval=1e-6,
    )
    assert run_job(spec).status == "already complete"
    records = Manifest(out / "_batchjob" / "manifest.jsonl").parts
    assert all(r.ino == (out / r.name).stat().st_ino for r in records)  # the copy's stamps, recorded
    flip_a_byte(out / records[0].name, at=20)  # a data page: and a change is still caught
    status = CliRunner().invoke(main, ["status", str(out)])
    assert f"missing or damaged: {records[0].name} is damaged" in status.output, status.output


def test_a_request_whose_sample_failed_is_a_failed_request_and_completions_list_the_chosen_token():
    """OpenAI has no error per choice: a request of n samples one of which failed was a 200 with a choice
    finished 'error' (not an OpenAI value), or, when sample 0 failed, a 400 naming sample 0 only; now any
    failed sample fails the request, naming it. Completions' top_logprobs hold the chosen token, as OpenAI's."""
    from batchjob.job.export import Result, _openai_line, _openai_logprobs
    from batchjob.job.state import JobInfo

    info = JobInfo(fingerprint={}, job_seed=1, schema=pa.schema([]))

    def row(i, error):
        text = None if error else "hi"
        return {
            "custom_id": "c",
            "sample_index": i,
            "error": error,
            "generated_text": text,
            "finish_reason": "error" if error else "stop",
            "num_prompt_tokens": 3,
            "num_generated_tokens": 1,
        }

    for failing in (0, 1):
        group = [Result(0, row(i, "cut" if i == failing else None)) for i in range(2)]
        line = _openai_line(group, info, None, "m", 0)
        assert line["response"]["status_code"] == 400
        assert line["error"]["message"] == f"sample {failing} of 2: cut"
    tokens = [{"token": "a", "logprob": -2.0, "top_logprobs": [{"token": "b", "logprob": -1.0}]}]
    lp = _openai_logprobs(tokens, completions=True, text="a")
    assert lp is not None and lp["top_logprobs"] == [{"b": -1.0, "a": -2.0}]


def test_input_columns_named_as_results_export_reads_are_renamed(tiny_model_dir, tmp_path):
    """An input 'sample_index', 'adapter' or 'embedding' in a job that writes none of them was kept under its
    name, and export took it for batchjob's own: rows out of order and merged into one request's choices, an
    embeddings response from the input's numbers, 'model' from its adapter text."""
    data = tmp_path / "in"
    data.mkdir()
    rows = [
        {"rid": f"r{i:02d}", "text": f"row {i}", "sample_index": i % 3, "adapter": "x", "embedding": [0.5]}
        for i in range(12)
    ]
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    run(data, out, shards=2, model=str(tiny_model_dir))
    assert [json.loads(x)["rid"] for x in export(out, "jsonl").splitlines()] == [r["rid"] for r in rows]
    lines = [json.loads(x) for x in export(out, "openai").splitlines()]
    assert [x["custom_id"] for x in lines] == [r["rid"] for r in rows]
    for x in lines:
        body = x["response"]["body"]
        assert body["object"] == "text_completion" or body["object"] == "chat.completion", body
        assert len(body["choices"]) == 1 and body["model"] != "x"
    got = ds.dataset(out, format="parquet").to_table()
    assert {"input_sample_index", "input_adapter", "input_embedding"} <= set(got.column_names)


def test_csv_quotes_a_value_holding_a_lone_carriage_return(tiny_model_dir, tmp_path):
    """With '\\n' line ends a value holding '\\r' went out unquoted, and csv readers (Python's, pandas')
    split the row there: 3 result rows read back as 6."""
    data = tmp_path / "in"
    data.mkdir()
    notes = ["one\rtwo", "three\r\nfour", "five"]
    (data / "a.jsonl").write_text(
        "".join(json.dumps({"rid": f"r{i}", "text": "hi", "note": n}) + "\n" for i, n in enumerate(notes))
    )
    out = tmp_path / "out"
    run(data, out, model=str(tiny_model_dir))
    target = tmp_path / "out.csv"
    assert (
        CliRunner().invoke(main, ["export", str(out), "--format", "csv", "--to", str(target)]).exit_code == 0
    )
    with open(target, newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert [r["note"] for r in got] == notes
