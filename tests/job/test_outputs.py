"""Outputs verified: a deleted or truncated part is found by ``status`` and redone by ``run``; ``--retry-errors``
redoes rows that failed; a crash in the middle of a manifest rewrite loses nothing and doubles nothing."""

from __future__ import annotations

import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.io.writers import EXTRA_FIELDS, PartWriter
from batchjob.job.inputs import InputRecord
from batchjob.job.manifest import Manifest, PartRecord
from batchjob.job.manifest import _digest as manifest_digest
from batchjob.job.state import JobInfo, StateDir
from batchjob.job.verify import check_parts, repair_outputs
from tests.jobproc import read_results as results
from tests.jobproc import sigterm_after_steps
from tests.tiers import engine_fixture

pytestmark = pytest.mark.timeout(300)

N_ROWS = 40
# A transient read error at line 30: the rest of the file becomes one error row (and is not read)
FLAKY_READ = {"BATCHJOB_FAULT_EIO": "reviews.jsonl:30"}
SAMPLED = ["--n", "2", "--temperature", "1", "--seed", "5"]


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    """Short reviews, and every seventh one long (over 100 prompt tokens)."""
    path = tmp_path_factory.mktemp("data") / "reviews.jsonl"
    rng = random.Random(0)
    words = ["great", "terrible", "fine", "broke", "love", "quality", "price", "arrived", "slow", "cheap"]
    with open(path, "w") as f:
        for i in range(N_ROWS):
            k = 40 if i % 7 == 3 else rng.randint(2, 6)
            f.write(json.dumps({"rid": f"r{i:02d}", "review": " ".join(rng.choices(words, k=k))}) + "\n")
    return path


@engine_fixture(scope="module")
def reference(reviews, tiny_model_dir, tmp_path_factory):
    """An uninterrupted greedy run of the job (the output folder), shared by the tests that compare with it."""
    ref = tmp_path_factory.mktemp("ref") / "out"
    run(reviews, ref, tiny_model_dir)
    return ref


def args(reviews, out, model, *extra):
    return [
        "--input",
        reviews,
        "--output",
        out,
        "--model",
        model,
        "--template",
        "Review: {review}\nSentiment:",
        "--id-column",
        "rid",
        "--max-new-tokens",
        "8",
        "--max-num-seqs",
        "2",
        "--checkpoint-interval",
        "0.1",  # a part every tenth of a second: several parts
        *extra,
    ]


def invoke(*argv):
    result = CliRunner().invoke(main, [str(a) for a in argv], catch_exceptions=False)
    return result.exit_code, result.output


def run(reviews, out, model, *extra):
    code, text = invoke("run", *args(reviews, out, model, *extra))
    assert code == 0, text
    return text


def parts(out):
    return Manifest(out / "_batchjob" / "manifest.jsonl").parts


def exported(out, to):
    """``batchjob export``'s JSONL lines of the job in ``out`` (written to ``to``)."""
    code, text = invoke("export", out, "--to", to)
    assert code == 0, text
    return to.read_text().splitlines()


def assert_same_rows(out, ref):
    got, expected = results(out), results(ref)
    assert [(r["rid"], r.get("sample_index")) for r in got] == [
        (r["rid"], r.get("sample_index")) for r in expected
    ]  # every id exactly once (n times with --n n)
    assert len({r["rid"] for r in got}) == N_ROWS
    assert got == expected  # every column


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_damaged_part_is_reported_then_redone(reviews, tiny_model_dir, tmp_path, reference, damage):
    out = tmp_path / "out"
    shutil.copytree(reference, out)  # a complete run of the job: the reference's folder, copied
    records = parts(out)
    assert len(records) >= 3 and all(r.size and r.result_rows for r in records)
    victim = records[len(records) // 2]
    path = out / victim.name
    if damage == "delete":
        path.unlink()
        reason = f"{victim.name} is missing"
    else:
        path.write_bytes(path.read_bytes()[: victim.size // 2])
        reason = f"{victim.name} has {victim.size // 2} bytes, {victim.size} recorded"

    code, text = invoke("status", out)
    assert code == 0, text
    assert f"{out}: incomplete" in text and "complete\n" not in text.split("\n")[0]
    assert f"{reason} ({victim.rows} rows)" in text
    assert f"{victim.rows} rows not done (1 parts missing or damaged)" in text and "batchjob run" in text
    assert f"rows: {N_ROWS - victim.rows} of {N_ROWS}" in text

    text = run(reviews, out, tiny_model_dir)
    assert f"{reason}: its {victim.rows} rows will be redone" in text
    assert "already complete" not in text and f"this run: {victim.rows} rows" in text
    assert victim.name not in {r.name for r in parts(out)} and not path.exists()  # its number not reused
    assert_same_rows(out, reference)
    code, text = invoke("status", out)
    assert code == 0 and f"{out}: complete" in text and "missing or damaged" not in text
    assert "already complete" in run(reviews, out, tiny_model_dir)


def test_new_parts_never_reuse_a_live_name(reviews, tiny_model_dir, tmp_path, reference):
    out = tmp_path / "out"
    shutil.copytree(reference, out)  # a complete run of the job: the reference's folder, copied
    records = parts(out)
    (out / records[0].name).unlink()  # the first part: the highest number stays listed
    run(reviews, out, tiny_model_dir)
    names = [r.name for r in parts(out)]
    assert len(names) == len(set(names)) and records[0].name not in names
    highest = max(int(r.name[5:11]) for r in records)
    assert min(int(n[5:11]) for n in names if n not in {r.name for r in records}) == highest + 1


@pytest.mark.parametrize("sampling", [[], SAMPLED], ids=["greedy", "n2-sampled"])
def test_retry_errors_redoes_rows_that_failed(
    reviews, tiny_model_dir, tmp_path, reference, sampling, monkeypatch
):
    ref, out = reference, tmp_path / "out"
    if sampling:
        ref = tmp_path / "ref"
        run(reviews, ref, tiny_model_dir, *sampling)
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    # One part at the end (no checkpoint in between, however slow the machine): it holds the error row and
    # good rows, so --retry-errors must rewrite a part, not only drop one.
    text = run(reviews, out, tiny_model_dir, *sampling, "--checkpoint-interval", "100000")
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    assert "complete: 30 of 30 rows done (1 errors)" in text, text  # the unread rest: one error row
    failed = [r for r in results(out) if r["error"]]
    assert len(failed) == 1 and "line 30: cannot read the rest of the file" in failed[0]["error"]
    before = parts(out)
    assert any(0 < r.errors < r.result_rows for r in before)  # a part to rewrite, not only to drop

    text = run(reviews, out, tiny_model_dir, *sampling)  # the disk is fine now, but without the flag...
    assert "already complete" in text
    assert sum(r["error"] is not None for r in results(out)) == len(failed)

    text = run(reviews, out, tiny_model_dir, *sampling, "--retry-errors")
    assert "--retry-errors:" in text and "complete:" in text and "already complete" not in text
    assert not any(r["error"] for r in results(out))
    assert_same_rows(out, ref)
    after = parts(out)
    assert sum(r.errors for r in after) == 0
    old = {r.name for r in before}
    assert not any((out / n).exists() for n in old - {r.name for r in after})  # replaced files deleted
    assert "already complete" in run(reviews, out, tiny_model_dir, *sampling, "--retry-errors")


def test_a_worker_of_several_stops_where_a_file_cannot_be_read(
    reviews, tiny_model_dir, tmp_path, reference, monkeypatch
):
    """The unread rest of a file is one error row, which one worker's share holds: the other said complete
    without its rows past it (no rerun or --retry-errors ever read them). Each worker stops there instead,
    saying so, and a rerun reads on."""
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    for shard in ("0", "1"):
        code, text = invoke(
            "run", *args(reviews, out, tiny_model_dir, "--num-shards", "2", "--shard-index", shard)
        )
        assert code == 2 and "line 30: cannot read the rest of the file" in text and "run it again" in text, (
            text
        )
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    for shard in ("0", "1"):
        run(reviews, out, tiny_model_dir, "--num-shards", "2", "--shard-index", shard)
    assert_same_rows(out, reference)


def test_a_resumed_job_stops_where_a_file_it_read_cannot_be_read_now(
    reviews, tiny_model_dir, tmp_path, reference, monkeypatch
):
    """A passing read error at a line an earlier run read made the rest of the file one error row, or none
    at a done line: the file's count dropped to it and the job said complete with the rest never read (64 of
    400 rows exported, 'complete: 64 of 2 rows done'). The run stops instead, saying so; a rerun reads on."""
    out = tmp_path / "out"
    with sigterm_after_steps(20):
        code, text = invoke("run", *args(reviews, out, tiny_model_dir))
    done = sorted(int(r["rid"][1:]) for r in results(out))
    assert code == 75 and 0 < len(done) < N_ROWS, text
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", f"reviews.jsonl:{done[-1] + 1}")  # the line of a done row
    code, text = invoke("run", *args(reviews, out, tiny_model_dir))
    assert code == 2 and f"line {done[-1] + 1}: cannot read the rest of the file" in text, text
    assert "an earlier run of the job read this file past there" in text
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    run(reviews, out, tiny_model_dir)
    assert_same_rows(out, reference)


def test_a_file_whose_rest_cannot_be_read_resumes_past_its_error_row_and_only_then(
    reviews, tiny_model_dir, tmp_path, reference, monkeypatch
):
    """The part's record says which done row was a file's unreadable rest. A job stopped after writing it
    (here by --max-errors) resumes past it while the file still can't be read (every rerun stopped, saying an
    earlier run read past there); and once a --retry-errors run has read on past it and been stopped, the
    same read error stops the job (it said 'complete: 22 of 11 rows', the rest never read)."""
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--max-errors", "1"))
    assert code == 1 and "stopped after 1 failed rows" in text, text
    text = run(reviews, out, tiny_model_dir)
    assert "complete: 30 of 30 rows done (1 errors)" in text, text
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    with sigterm_after_steps(20):  # the file reads again: the retry reads on past line 30, then stops
        code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--retry-errors"))
    assert code == 75 and any(int(r["rid"][1:]) >= 30 for r in results(out)), text
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    code, text = invoke("run", *args(reviews, out, tiny_model_dir))
    assert code == 2 and "an earlier run of the job read this file past there" in text, text
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    run(reviews, out, tiny_model_dir)
    assert_same_rows(out, reference)


def test_a_retry_that_reads_on_past_an_unreadable_rest_counts_the_file_anew(
    reviews, tiny_model_dir, tmp_path, reference, monkeypatch
):
    """A read error made the rest of the file one error row, and the file's row count where the read failed
    (30 of its 40 rows). A --retry-errors run reads on past it; stopped partway, it left that count standing:
    status said 'rows: 33 of 30 input rows (110.0%)' (and a run stopped before it read to the end,
    'interrupted: 31 of 30 rows done'). Taking the row back forgets the count: unknown until the file is read
    to its end. Stopped and resumed, its export has each row once, in input order, with its newest result:
    the uninterrupted run's."""
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    assert "complete: 30 of 30 rows done (1 errors)" in run(reviews, out, tiny_model_dir)
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    with sigterm_after_steps(20):
        code, text = invoke("run", *args(reviews, out, tiny_model_dir, "--retry-errors"))
    done = len(results(out))
    assert code == 75 and 30 < done < N_ROWS and f"interrupted: {done} of {N_ROWS} rows done" in text, text
    code, text = invoke("status", out)
    assert code == 0 and f"rows: {done} of unknown input rows\n" in text, text
    expected = exported(reference, tmp_path / "ref.jsonl")
    lines = exported(out, tmp_path / "stopped.jsonl")  # each done row once, in order, its newest result
    rids = [json.loads(line)["rid"] for line in lines]
    assert len(lines) == done and rids == sorted(set(rids)) and set(lines) <= set(expected)
    run(reviews, out, tiny_model_dir, "--retry-errors")
    code, text = invoke("status", out)
    assert f"{out}: complete" in text and f"rows: {N_ROWS} of {N_ROWS} input rows (100.0%)" in text, text
    assert_same_rows(out, reference)
    assert exported(out, tmp_path / "resumed.jsonl") == expected


@pytest.mark.parametrize("point", ["after_part_rewrite", "after_manifest_rewrite"])
def test_a_crash_in_the_middle_of_a_rewrite_loses_and_doubles_nothing(
    launch, reviews, tiny_model_dir, tmp_path, reference, point, monkeypatch
):
    ref, out = reference, tmp_path / "out"
    monkeypatch.setenv("BATCHJOB_FAULT_EIO", FLAKY_READ["BATCHJOB_FAULT_EIO"])
    text = run(reviews, out, tiny_model_dir)  # in this process: only the killed run needs one of its own
    monkeypatch.delenv("BATCHJOB_FAULT_EIO")
    assert "1 errors" in text, text
    before = {r.name for r in parts(out)}
    proc = launch(
        [str(a) for a in args(reviews, out, tiny_model_dir, "--retry-errors")], BATCHJOB_FAULT_KILL=point
    )
    text = proc.communicate(timeout=240)[0]
    assert proc.returncode == 137, text
    listed = {r.name for r in parts(out)}
    on_disk = {p.name for p in out.glob("part-*.parquet")}
    if point == "after_part_rewrite":  # new parts written, not listed: orphans
        assert listed == before and on_disk > before
    else:  # the manifest names the new parts; the replaced ones are orphans
        assert listed != before and on_disk == listed | before
    code, text = invoke("status", out)
    # no longer complete (the flag was saved first), though no part is damaged
    assert code == 0 and f"{out}: incomplete" in text and "missing or damaged" not in text
    run(reviews, out, tiny_model_dir, "--retry-errors")
    assert {p.name for p in out.glob("part-*.parquet")} == {r.name for r in parts(out)}
    assert not any(r["error"] for r in results(out))
    assert_same_rows(out, ref)


def test_retry_maps_error_rows_to_ordinals_and_old_records_are_checked(tmp_path):
    """--n 2: a row failed before the engine has one result row, an engine error has one per sample; an
    ordinal with an error in any sample is redone whole. Records from before sizes were recorded are
    checked for existence and a readable footer."""
    schema = pa.schema([pa.field("rid", pa.string())])
    writer = PartWriter(tmp_path, schema, extra=(EXTRA_FIELDS["sample_index"],))
    rows = []
    for ordinal, errors in [(0, [None, None]), (1, ["bad row"]), (2, [None, "engine"]), (3, [None, None])]:
        for k, error in enumerate(errors):
            rows.append(
                {
                    "values": {"rid": f"r{ordinal}"},
                    "generated_text": None if error else "ok",
                    "finish_reason": "error" if error else "stop",
                    "num_prompt_tokens": 5,
                    "num_generated_tokens": 0 if error else 2,
                    "error": error,
                    "sample_index": k,
                }
            )
    name = writer.write(0, rows)
    (tmp_path / "_batchjob").mkdir()
    state = StateDir(tmp_path)
    info = JobInfo({}, 0, schema, [InputRecord(0, "a.jsonl", "jsonl", 10, 1, "full:x", True, 4)])
    info.mark_complete()
    state.save_job(info)
    # a line as written before sizes and footer rows were recorded
    body = {"name": name, "rows": 4, "errors": 3, "prompt_tokens": 35, "generated_tokens": 10}
    body["ordinals"] = [[0, 4]]
    line = {"part": body, "sha": manifest_digest(body)}
    state.manifest_file.write_text(json.dumps(line, separators=(",", ":")) + "\n")
    manifest = Manifest(state.manifest_file)
    assert manifest.parts[0].size is None and manifest.parts[0].result_rows is None
    assert check_parts(tmp_path, manifest) == []

    assert repair_outputs(state, info, manifest, writer, retry_errors=True) == 2
    assert not info.complete and not state.load_job().complete
    [record] = Manifest(state.manifest_file).parts
    assert record.name == "part-000001.parquet" and not (tmp_path / name).exists()
    assert record.ordinals == [[0, 1], [3, 4]] and record.rows == 2 and record.errors == 0
    assert (
        record.result_rows == 4 and record.prompt_tokens == 10 and record.generated_tokens == 8
    )  # each prompt once
    table = pq.read_table(tmp_path / record.name)
    assert table.column("rid").to_pylist() == ["r0", "r0", "r3", "r3"]
    assert table.schema.equals(writer.schema)

    (tmp_path / record.name).write_bytes(b"not parquet at all")
    old = PartRecord(record.name, 2, 0, 20, 8, [[0, 1], [3, 4]])
    other = Manifest(tmp_path / "old.jsonl")
    other.append(old)
    [problem] = check_parts(tmp_path, other)
    assert "unreadable Parquet footer" in problem.reason
