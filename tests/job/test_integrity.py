"""A job notices every change to its inputs, ids and model: it refuses, naming what changed, or (``--append``)
processes exactly the new rows; it never reports "complete" over stale or missing rows."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob import digest
from batchjob.cli import main
from batchjob.errors import InputError
from batchjob.io import identity
from batchjob.io.readers import iter_rows
from batchjob.io.schema import input_schema
from batchjob.io.sources import discover
from batchjob.job import make_spec, run_job
from batchjob.job.inputs import InputChangedError, new_records, reconcile
from batchjob.job.shard import Shard
from batchjob.job.state import JobMismatchError
from tests.jobproc import run_here
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(300)


def write_rows(path, rows, bom=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def rows(n, start=0, prefix="r"):
    return [{"rid": f"{prefix}{i}", "text": f"review number {i} was fine"} for i in range(start, start + n)]


def spec(inputs, out, model, **kw):
    inputs = inputs if isinstance(inputs, list) else [inputs]
    fields = dict(max_new_tokens=3, max_num_seqs=4, chat=False) | kw
    return make_spec(input=[str(p) for p in inputs], output=str(out), model=str(model), **fields)


def results(out):
    table = ds.dataset(out, format="parquet").to_table()
    return sorted(
        table.to_pylist(), key=lambda r: (str(r.get("rid")), r.get("input_text") or r.get("text") or "")
    )


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# -- inputs by content ------------------------------------------------------------------------------------


def test_appended_rows_are_refused_then_processed_with_append(tmp_path, tiny_model_dir):
    data = write_rows(tmp_path / "a.jsonl", rows(6))
    out = tmp_path / "out"
    assert run_job(spec(data, out, tiny_model_dir, id_column="rid")).status == "complete"
    with open(data, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows(3, start=6)))
    with pytest.raises(InputChangedError, match=r"a\.jsonl: grew by .* run with --append"):
        run_job(spec(data, out, tiny_model_dir, id_column="rid"))
    r = cli("status", out)  # status says so too, never "complete"
    assert r.exit_code == 0 and "incomplete" in r.output and "a.jsonl" in r.output, r.output
    r = cli("export", out, "--to", tmp_path / "x.jsonl")  # its hint names --append (a plain rerun is refused)
    assert r.exit_code == 0 and "are done; run it again with --append to take in" in r.output, r.output
    result = run_job(spec(data, out, tiny_model_dir, id_column="rid", append=True))
    assert result.status == "complete" and result.rows_done == 9 and result.rows_total == 9
    fresh = tmp_path / "fresh"
    run_job(spec(data, fresh, tiny_model_dir, id_column="rid"))
    assert results(out) == results(fresh)  # the old rows kept, the new ones added, each once
    assert run_job(spec(data, out, tiny_model_dir, id_column="rid")).status == "already complete"


def test_files_of_one_name_under_two_input_values_resume_with_append(tmp_path, tiny_model_dir):
    """Two --input values that give files one name were named by their places in the list, and only once
    they clashed: a file added since under one value (a first x.jsonl beside another's, or a w.jsonl before
    a clashing pair) renamed the others, and --append refused the job, its files "removed"."""
    for case, first, added in (("arises", ["a/x", "b/y"], "b/x"), ("moves", ["a/x", "b/x"], "a/w")):
        root = tmp_path / case
        for name in first:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            write_rows(root / f"{name}.jsonl", rows(2, prefix=name))
        out, values = tmp_path / f"out-{case}", [root / "a", root / "b"]
        assert run_job(spec(values, out, tiny_model_dir)).status == "complete"
        write_rows(root / f"{added}.jsonl", rows(2, prefix=added))
        result = run_job(spec(values, out, tiny_model_dir, append=True))
        assert result.status == "complete" and result.rows_done == 6, case
        assert sorted(r["rid"] for r in results(out)) == sorted(
            f"{n}{i}" for n in [*first, added] for i in range(2)
        )


def test_names_as_the_records_have_them_or_a_refusal_naming_both_files(tmp_path):
    """A resume names each file as the job's record does: by its inode among the names it can have (an
    earlier batchjob's place in the list, 2/x.jsonl, too); two files that one record's name could be, with
    nothing to tell them apart, are refused naming both; so are two files a new job would name alike."""
    from batchjob.io.sources import job_names
    from batchjob.job.inputs import named_as_recorded, record_for

    for name in ("a/w", "a/x", "b/x"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write_rows(tmp_path / f"{name}.jsonl", rows(1, prefix=name))
    found = discover([str(tmp_path / "a"), str(tmp_path / "b")])
    assert [s.name for s in found] == ["w.jsonl", "0/x.jsonl", "1/x.jsonl"]
    legacy = [f"{i}/{s.plain}" for i, s in enumerate(found)]  # an earlier batchjob's names on a clash
    records = [replace(record_for(s, i), name=n) for i, (s, n) in enumerate(zip(found, legacy, strict=True))]
    assert [s.name for s in named_as_recorded(records, found)] == legacy
    # the --input values given in the other order: each file finds its record by inode (they were given
    # each other's, and the resume was refused as both "changed")
    records = [record_for(s, i) for i, s in enumerate(found)]
    swapped = discover([str(tmp_path / "b"), str(tmp_path / "a")])
    assert [s.name for s in swapped] == ["0/x.jsonl", "w.jsonl", "1/x.jsonl"]
    named = {s.path: s.name for s in named_as_recorded(records, swapped)}
    assert named == {s.path: s.name for s in found}
    # the record of b/x named x.jsonl (before a/x was added): without its inode, a/x could be it too
    records = [replace(record_for(found[2], 0), name="x.jsonl", ino=None)]
    with pytest.raises(InputError, match=r"'x.jsonl' can be any of .*a/x.jsonl, .*b/x.jsonl"):
        named_as_recorded(records, found)
    records = [replace(record_for(found[2], 0), name="x.jsonl")]  # with it: b/x, and a/x is a new file
    assert [s.name for s in named_as_recorded(records, found)] == ["w.jsonl", "0/x.jsonl", "x.jsonl"]
    # a folder's own 1/x.jsonl beside the second value's clashing x.jsonl: one name for two files
    (tmp_path / "a" / "1").mkdir()
    write_rows(tmp_path / "a" / "1" / "x.jsonl", rows(1))
    with pytest.raises(
        InputError, match=r"input files .*a/1/x.jsonl and .*b/x.jsonl would both be named '1/x.jsonl'"
    ):
        discover([str(tmp_path / "a"), str(tmp_path / "b")])
    assert job_names(found) == ["w.jsonl", "0/x.jsonl", "1/x.jsonl"]


def test_new_file_in_the_middle_keeps_every_done_row(tmp_path, tiny_model_dir):
    folder = tmp_path / "in"
    folder.mkdir()
    write_rows(folder / "a.jsonl", rows(4, prefix="a"))
    write_rows(folder / "c.jsonl", rows(4, prefix="c"))
    out = tmp_path / "out"
    run_job(spec(folder, out, tiny_model_dir))
    write_rows(folder / "b.jsonl", rows(4, prefix="b"))  # sorts between the two
    r = cli(
        "run",
        "--input",
        folder,
        "--output",
        out,
        "--model",
        tiny_model_dir,
        "--max-new-tokens",
        3,
        "--no-chat",
    )
    assert r.exit_code == 2 and "b.jsonl: new file" in r.output, r.output
    result = run_job(spec(folder, out, tiny_model_dir, append=True))
    assert result.status == "complete" and result.rows_done == 12
    fresh = tmp_path / "fresh"
    run_job(spec(folder, fresh, tiny_model_dir))
    assert results(out) == results(fresh)


@pytest.mark.parametrize("change", ["edit", "insert_top", "swap", "remove", "shrink"])
def test_changed_inputs_are_refused_naming_each_file(tmp_path, tiny_model_dir, change):
    folder = tmp_path / "in"
    folder.mkdir()
    a = write_rows(folder / "a.jsonl", rows(5, prefix="a"))
    b = write_rows(folder / "b.jsonl", rows(5, prefix="b"))
    out = tmp_path / "out"
    run_job(spec(folder, out, tiny_model_dir, id_column="rid"))
    if change == "edit":  # same size, one word changed in place
        a.write_text(a.read_text().replace("number 3 was fine", "number 3 was good"))
        want = [r"a\.jsonl: changed \(same size"]
    elif change == "insert_top":
        a.write_text(json.dumps({"rid": "new", "text": "x"}) + "\n" + a.read_text())
        want = [r"a\.jsonl: changed \(grew"]
    elif change == "swap":
        ta, tb = a.read_text(), b.read_text()
        a.write_text(tb)
        b.write_text(ta)
        want = [r"a\.jsonl: changed", r"b\.jsonl: changed"]
    elif change == "remove":
        b.unlink()
        want = [r"b\.jsonl: removed"]
    else:
        a.write_text("".join(a.read_text().splitlines(keepends=True)[:3]))
        want = [r"a\.jsonl: changed \(shrank"]
    for append in (False, True):  # --append takes in growth only, never these
        with pytest.raises(InputChangedError) as e:
            run_job(spec(folder, out, tiny_model_dir, id_column="rid", append=append))
        for pattern in want:
            assert re.search(pattern, str(e.value)), str(e.value)
    r = cli(
        "validate",
        "--input",
        folder,
        "--output",
        out,
        "--model",
        tiny_model_dir,
        "--id-column",
        "rid",
        "--max-new-tokens",
        3,
        "--no-chat",
    )
    assert r.exit_code == 2 and "changed since it started" in r.output
    r = cli("export", out, "--to", tmp_path / "x.jsonl")  # not "run it again": that is refused
    assert r.exit_code == 0 and "restore the inputs it started with, run it again, then export" in r.output


def test_touched_but_equal_small_file_is_accepted(tmp_path, tiny_model_dir):
    data = write_rows(tmp_path / "a.jsonl", rows(4))
    out = tmp_path / "out"
    run_job(spec(data, out, tiny_model_dir))
    os.utime(data, ns=(1, 1))  # copied without its time stamp: read whole again, and equal
    assert run_job(spec(data, out, tiny_model_dir)).status == "already complete"


def test_large_file_identity_by_samples_and_time_stamp(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "FULL_BYTES", 4 << 20)  # the digest's bound, and the one inputs.py names
    monkeypatch.setattr(identity, "FULL_BYTES", 4 << 20)
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 200}) + "\n"
    path.write_text(line * 40_000)  # ~8 MiB: sampled, not read whole
    sources = discover([str(path)])
    saved = new_records(sources)
    assert saved[0].digest.startswith("sampled:")
    st = os.stat(path)
    # a byte changed in a sampled block: noticed even with the time stamp put back
    data = bytearray(path.read_bytes())
    data[10] = ord("y")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(InputChangedError, match="changed"):
        reconcile(saved, sources, False, tmp_path)
    data[10] = ord("x")
    # a change between the samples: the time stamp gives it away, and the message says how to go on
    span = len(data) - digest._EDGE - digest._BLOCK
    between = digest._EDGE + span * 1 // (digest._BLOCKS + 1) + digest._BLOCK + 100  # after block 1
    assert between + 100 < digest._EDGE + span * 2 // (digest._BLOCKS + 1)  # and before block 2
    assert data[between] == ord("x")
    data[between] = ord("y")
    path.write_bytes(bytes(data))
    with pytest.raises(InputChangedError, match=r"touch -d @\d+\.\d{9} .*big\.jsonl"):
        reconcile(saved, sources, False, tmp_path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # what the hint says to do, if it is unchanged
    [now] = reconcile(saved, sources, False, tmp_path)[0]
    assert (now.size, now.digest, now.mtime_ns) == (saved[0].size, saved[0].digest, saved[0].mtime_ns)
    # grown: --append can check the old part only as it was recorded, in samples, and says so
    with open(path, "a") as f:
        f.write(line)
    _, [taken], _ = reconcile(saved, discover([str(path)]), True, tmp_path)
    assert "checked in samples, not whole: a row edited in place there keeps its old result" in taken


def test_files_swapped_by_name_in_one_time_stamp_tick_are_refused(tmp_path, tiny_model_dir):
    """Same sizes, same time stamps, contents swapped by renames: the inode and ctime say they are not the
    files that were read, so they are read again and told apart by content."""
    folder = tmp_path / "in"
    folder.mkdir()
    a = write_rows(folder / "a.jsonl", rows(3, prefix="a"))
    b = write_rows(folder / "b.jsonl", rows(3, prefix="b"))
    assert a.stat().st_size == b.stat().st_size
    for p in (a, b):
        os.utime(p, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))  # one tick
    out = tmp_path / "out"
    assert run_job(spec(folder, out, tiny_model_dir, id_column="rid")).status == "complete"
    os.rename(a, folder / "t.jsonl")
    os.rename(b, a)
    os.rename(folder / "t.jsonl", b)
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (b.stat().st_size, b.stat().st_mtime_ns)
    with pytest.raises(InputChangedError) as e:
        run_job(spec(folder, out, tiny_model_dir, id_column="rid"))
    assert "a.jsonl: changed (same size, different content)" in str(e.value)
    assert "b.jsonl: changed (same size, different content)" in str(e.value)
    r = cli("status", out)
    assert "incomplete" in r.output and "a.jsonl: changed" in r.output, r.output
    # swapped back, they are the files that were read: the job is complete again, nothing redone
    os.rename(a, folder / "t.jsonl")
    os.rename(b, a)
    os.rename(folder / "t.jsonl", b)
    assert run_job(spec(folder, out, tiny_model_dir, id_column="rid")).status == "already complete"


def test_parquet_cannot_grow_even_with_append(tmp_path, tiny_model_dir):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(4)]}), path)
    out = tmp_path / "out"
    run_job(spec(path, out, tiny_model_dir))
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(8)]}), path)
    with pytest.raises(InputChangedError, match=r"a\.parquet: changed"):
        run_job(spec(path, out, tiny_model_dir, append=True))


def test_appended_file_with_other_columns_is_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "in"
    folder.mkdir()
    write_rows(folder / "a.jsonl", rows(3))
    out = tmp_path / "out"
    run_job(spec(folder, out, tiny_model_dir))
    write_rows(folder / "b.jsonl", [{"text": "hi", "extra": 1}])
    with pytest.raises(InputChangedError, match=r"b\.jsonl: column 'extra' is new"):
        run_job(spec(folder, out, tiny_model_dir, append=True))



def test_an_appended_parquet_file_is_held_to_the_columns_a_job_of_both_would_have(tmp_path, tiny_model_dir):
    """A new file's int column beside the job's text column was taken and its 3 written as '3'; a fresh job
    of both files is refused ("column 'x' is string in ... but int64 in ..."), and so is the append now. A
    JSONL file's value goes into a text column as its JSON text, as a JSONL key's mixed values do."""
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "x": ["s", "t"]}), folder / "a.parquet")
    out = tmp_path / "out"
    run_job(spec(folder, out, tiny_model_dir))
    pq.write_table(pa.table({"text": ["c"], "x": [3]}), folder / "b.parquet")
    with pytest.raises(InputChangedError, match=r"b\.parquet: column 'x' is int64 here but string in the job"):
        run_job(spec(folder, out, tiny_model_dir, append=True))
    (folder / "b.parquet").unlink()
    write_rows(folder / "c.jsonl", [{"text": "c", "x": 3}])
    run_job(spec(folder, out, tiny_model_dir, append=True))
    assert sorted(ds.dataset(out, format="parquet").to_table()["x"].to_pylist()) == ["3", "s", "t"]
    # text of another text type (polars' large_string, a pandas categorical) is text, as in a fresh job
    text = pa.array(["d"], pa.large_string())
    pq.write_table(pa.table({"text": text, "x": pa.array(["u"]).dictionary_encode()}), folder / "d.parquet")
    run_job(spec(folder, out, tiny_model_dir, append=True))
    assert sorted(ds.dataset(out, format="parquet").to_table()["x"].to_pylist()) == ["3", "s", "t", "u"]


# -- ids unique job-wide ----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_far_duplicate_id_is_an_error_row_whatever_the_settings(tmp_path, tiny_model_dir, max_num_seqs):
    data = rows(40)
    data[37]["rid"] = "r2"  # far beyond any in-flight window
    path = write_rows(tmp_path / "a.jsonl", data)
    out = tmp_path / "out"
    run_job(spec(path, out, tiny_model_dir, id_column="rid", max_num_seqs=max_num_seqs))
    got = ds.dataset(out, format="parquet").to_table().to_pylist()
    errors = [r for r in got if r["error"]]
    assert len(got) == 40 and len(errors) == 1
    assert errors[0]["text"] == "review number 37 was fine"
    assert "duplicate id 'r2': first used by row a.jsonl:2" in errors[0]["error"]


def test_duplicate_id_across_workers_and_a_lost_index(tmp_path, tiny_model_dir):
    data = rows(30)
    data[29]["rid"] = "r0"  # row 0 belongs to shard 0, row 29 to shard 1 (chunks of 1 row)
    path = write_rows(tmp_path / "a.jsonl", data)
    out = tmp_path / "out"
    for i in range(2):
        run_job(spec(path, out, tiny_model_dir, id_column="rid"), shard=Shard(i, 2))
    got = ds.dataset(out, format="parquet").to_table().to_pylist()
    errors = [r for r in got if r["error"]]
    assert len(got) == 30 and [e["text"] for e in errors] == ["review number 29 was fine"]
    assert "first used by row a.jsonl:0" in errors[0]["error"]
    # the index is a cache: lost or damaged, it is built again from the inputs
    dbs = sorted(out.glob("_batchjob/*/ids.sqlite"))
    assert len(dbs) == 2
    dbs[0].unlink()
    dbs[1].write_bytes(b"this is not a database" * 100)
    with open(path, "a") as f:
        f.write(json.dumps({"rid": "r5", "text": "a late duplicate"}) + "\n")  # row 30: shard 0's
    for i in range(2):
        job = spec(path, out, tiny_model_dir, id_column="rid", append=True)
        assert run_job(job, shard=Shard(i, 2)).status == "complete"
    got = ds.dataset(out, format="parquet").to_table().to_pylist()
    errors = sorted(r["error"] for r in got if r["error"])
    assert len(got) == 31 and len(errors) == 2
    assert "duplicate id 'r5': first used by row a.jsonl:5" in errors[1]  # row 5 is the other worker's


def test_counts_of_workers_that_have_not_taken_in_an_append_are_not_applied_to_it(tmp_path, tiny_model_dir):
    """One worker of four takes in 20 appended rows: the others' counts (40) are for the file as it was, and
    status, export and report total 60 input rows (they said "45 of 40 input rows (112.5%)")."""
    path = write_rows(tmp_path / "a.jsonl", rows(40))
    out = tmp_path / "out"

    def worker(i, **kw):
        return run_job(spec(path, out, tiny_model_dir, id_column="rid", **kw), shard=Shard(i, 4))

    assert all(worker(i).status == "complete" for i in range(4))
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows(20, start=40)))
    assert worker(3, append=True).rows_done == 15
    text = cli("status", out).output
    assert "rows: 45 of 60 input rows (75.0%)" in text, text
    assert "shard 0 of 4: stopped, 10 of 15 rows" in text and "shard 3 of 4: complete, 15 of 15 rows" in text
    assert "45 of 60 input rows are done" in cli("export", out, "--to", tmp_path / "x.jsonl").output
    assert all(worker(i, append=True).rows_done == 15 for i in range(3))  # the others take the rows in too
    text = cli("status", out).output
    assert "complete (4 of 4 workers complete)" in text and "rows: 60 of 60 input rows" in text, text


# -- inputs that are odd but fine, and mistakes ----------------------------------------------------------


def test_empty_first_file_and_bom(tmp_path, tiny_model_dir):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")  # sorts first, has no columns
    write_rows(folder / "b.jsonl", rows(3), bom=True)
    write_rows(folder / "c.jsonl", [{"rid": "c0", "text": "more", "score": 1.5}])
    schema = input_schema(discover([str(folder)]))
    assert schema.names == ["rid", "text", "score"]
    out = tmp_path / "out"
    run_job(spec(folder, out, tiny_model_dir))
    got = results(out)
    assert len(got) == 4 and not any(r["error"] for r in got)  # the BOM row is a row like the others
    assert {r["score"] for r in got} == {None, 1.5}


def test_parquet_type_conflict_names_both_files(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "n": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["b"], "n": ["one"]}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"column 'n' is int64 in .*a\.parquet but string in .*b\.parquet"):
        input_schema(discover([str(tmp_path)]))


def test_empty_input_is_a_usage_error(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "other.jsonl", rows(2))  # what an empty --input would have read
    for args in (["--input", ""], ["--input", "  "]):
        for command in ("run", "validate"):
            r = cli(command, *args, "--output", tmp_path / "out", "--model", tiny_model_dir)
            assert r.exit_code == 2 and "--input is empty" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_glob_never_reads_the_jobs_own_output(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_rows(tmp_path / "data" / "a.jsonl", rows(3))
    args = [
        "run",
        "--input",
        "*/*.*",
        "--output",
        "out",
        "--model",
        tiny_model_dir,
        "--max-new-tokens",
        3,
        "--no-chat",
    ]
    assert cli(*args).exit_code == 0
    assert list((tmp_path / "out").glob("*.parquet"))  # a part the glob now matches
    r = cli(*args)
    assert r.exit_code == 0 and "already complete: 3 rows" in r.output, r.output


# -- the model by content --------------------------------------------------------------------------------


def test_replaced_weights_are_refused(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = write_rows(tmp_path / "a.jsonl", rows(3))
    out = tmp_path / "out"
    run_job(spec(data, out, model))
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)  # the same model under another path: the same job
    assert run_job(spec(data, out, moved)).status == "already complete"
    make_model(tmp_path / "other", "llama", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", model / "model.safetensors")
    with pytest.raises(JobMismatchError, match=r"model files: model\.safetensors changed"):
        run_job(spec(data, out, model))


def test_default_model_has_one_identity_whatever_it_is_called():
    from batchjob.job.prepare import model_fingerprint

    names = [None, "default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    identities = [model_fingerprint(n) for n in names]
    assert all(i["content"] == identities[0]["content"] for i in identities)
    assert all(i["files"] == identities[0]["files"] for i in identities)


def test_reader_reports_ids_of_rows_it_passes_over(tmp_path):
    pq.write_table(
        pa.table({"rid": [f"p{i}" for i in range(5)], "text": ["t"] * 5}),
        tmp_path / "a.parquet",
        row_group_size=2,
    )
    write_rows(tmp_path / "b.jsonl", rows(3))
    seen = []
    sources = discover([str(tmp_path)])
    got = list(
        iter_rows(
            sources,
            skip=lambda o: o % 2 == 0 or o == 3,  # 2 and 3: a whole batch passed over
            covered=lambda a, b: a == 2,
            on_skipped=lambda o, v: seen.append((o, v)),
            id_column="rid",
        )
    )
    assert [r.ordinal for r in got] == [1, (1 << 40) + 1]
    assert seen == [(0, "p0"), (2, "p2"), (3, "p3"), (4, "p4"), (1 << 40, "r0"), ((1 << 40) + 2, "r2")]


def test_a_growing_log_caught_mid_line_is_finished_with_append(tmp_path, tiny_model_dir):
    """A JSONL log read while its last line was half-written: that row is an error row; once the line is
    finished and more rows appended, --append takes in the new rows and redoes that one from its whole line
    (docs/jobs.md: a scheduled job over a growing log)."""
    data = tmp_path / "log.jsonl"
    whole = "".join(json.dumps(r) + "\n" for r in rows(7))
    lines = whole.splitlines(keepends=True)
    cut = sum(map(len, lines[:4])) + 11  # four rows and a torn fifth
    data.write_text(whole[:cut])
    out = tmp_path / "out"
    first = run_job(spec(data, out, tiny_model_dir, id_column="rid"))
    assert first.status == "complete" and first.rows_done == 5 and first.errors == 1
    with open(data, "a") as f:  # the writer finishes its line and goes on
        f.write(whole[cut:])
    with pytest.raises(InputChangedError, match=r"run with --append .* redo row 4"):
        run_job(spec(data, out, tiny_model_dir, id_column="rid"))
    for retry in (True, False):  # --retry-errors is no hindrance
        result = run_job(spec(data, out, tiny_model_dir, id_column="rid", append=True, retry_errors=retry))
        assert result.status == "complete" and result.rows_done == 7 and result.errors == 0
        assert result.stats["rows"] == 3  # the finished row and the two new ones; nothing else redone
        fresh = tmp_path / f"fresh{retry}"
        run_job(spec(data, fresh, tiny_model_dir, id_column="rid"))
        assert results(out) == results(fresh)
        assert [r["rid"] for r in results(out)] == [f"r{i}" for i in range(7)]
        if retry:  # the same again, from the torn state, without --retry-errors
            shutil.rmtree(out)
            data.write_text(whole[:cut])
            run_job(spec(data, out, tiny_model_dir, id_column="rid"))
            with open(data, "a") as f:
                f.write(whole[cut:])
    assert run_job(spec(data, out, tiny_model_dir, id_column="rid", append=True)).status == "already complete"


@pytest.mark.parametrize("point", ["after_part_rewrite", "after_manifest_rewrite"])
def test_finishing_a_torn_line_survives_a_kill_at_any_step(launch, tmp_path, tiny_model_dir, point):
    """Killed while taking back the torn row (part rewritten, or manifest rewritten but the grown file not
    yet recorded): the next --append finds the same row to redo, and the job ends as a fresh run would."""

    data = tmp_path / "log.jsonl"
    whole = "".join(json.dumps(r) + "\n" for r in rows(6))
    cut = len(whole) - 20
    data.write_text(whole[:cut])
    out = tmp_path / "out"
    argv = ["--input", data, "--output", out, "--model", tiny_model_dir, "--id-column", "rid"]
    argv = [str(a) for a in [*argv, "--max-new-tokens", "3", "--max-num-seqs", "4", "--no-chat"]]
    code, text = run_here(argv)  # in this process: only the killed run below needs one of its own
    assert code == 0 and text.count("1 errors") == 1, text
    with open(data, "a") as f:
        f.write(whole[cut:] + json.dumps({"rid": "r6", "text": "one more"}) + "\n")
    killed = launch([*argv, "--append"], BATCHJOB_FAULT_KILL=point)
    text = killed.communicate(timeout=240)[0]
    assert killed.returncode == 137 and "1 rows will be redone (its input line was not finished" in text, text
    code, text = run_here([*argv, "--append"])  # what the killed run left on disk is the point
    assert code == 0 and "complete: 7 of 7 rows done (0 errors)" in text, text
    fresh = tmp_path / "fresh"
    run_job(spec(data, fresh, tiny_model_dir, id_column="rid"))
    assert results(out) == results(fresh)
