"""The state folder is not taken on trust either: a manifest that lost lines is no complete job (its rows are
redone), results without the job file that made them are refused, and those who only look (status, export)
never cut the manifest a running worker appends to."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.errors import StateError
from batchjob.job import make_spec, run_job

pytestmark = pytest.mark.timeout(300)


def _data(path, n, start=0):
    with open(path, "a") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"rid": f"r{i}", "text": f"review number {i} was fine"}) + "\n")
    return path


def _spec(data, out, model, **kw):
    fields = dict(max_new_tokens=3, chat=False, id_column="rid") | kw
    return make_spec(input=[str(data)], output=str(out), model=str(model), **fields)


def _results(out):
    return sorted(ds.dataset(out, format="parquet").to_table().to_pylist(), key=lambda r: r["rid"])


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("lost", ["the last line", "the whole file"])
def test_a_manifest_that_lost_lines_is_incomplete_and_the_run_redoes_its_rows(tmp_path, tiny_model_dir, lost):
    data, out = _data(tmp_path / "a.jsonl", 6), tmp_path / "out"
    assert run_job(_spec(data, out, tiny_model_dir)).status == "complete"
    _data(data, 3, start=6)
    assert run_job(_spec(data, out, tiny_model_dir, append=True)).status == "complete"  # a second part
    manifest = out / "_batchjob" / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    manifest.write_bytes(lines[0] if lost == "the last line" else b"")
    listed = 6 if lost == "the last line" else 0
    r = _cli("status", out)
    assert r.exit_code == 0 and f"{out}: incomplete" in r.output, r.output
    assert (
        f"its manifest lists {listed} of 9 rows ({9 - listed} lost from it): `batchjob run` redoes"
        in r.output
    )
    result = run_job(_spec(data, out, tiny_model_dir))
    assert result.status == "complete" and result.rows_done == 9
    fresh = tmp_path / "fresh"
    run_job(_spec(data, fresh, tiny_model_dir))
    assert _results(out) == _results(fresh)  # every row once: the unlisted part's file went as an orphan
    assert f"{out}: complete" in _cli("status", out).output


def test_results_without_their_job_file_are_refused(tmp_path, tiny_model_dir):
    data, out = _data(tmp_path / "a.jsonl", 4), tmp_path / "out"
    run_job(_spec(data, out, tiny_model_dir))
    (out / "_batchjob" / "job.json").unlink()
    with pytest.raises(StateError, match=r"holds results \(.*\) but not the job file _batchjob/job.json"):
        run_job(_spec(data, out, tiny_model_dir, template="Summarize: {text}"))  # another job's results
    r = _cli("run", "--input", data, "--output", out, "--model", tiny_model_dir, "--no-chat")
    assert r.exit_code != 0 and "not the job file" in r.output and "Traceback" not in r.output, r.output


def test_status_and_export_leave_a_torn_manifest_line_alone(tmp_path, tiny_model_dir):
    """A worker may be appending that line right now (status runs from any node): only the worker cuts it."""
    data, out = _data(tmp_path / "a.jsonl", 4), tmp_path / "out"
    run_job(_spec(data, out, tiny_model_dir))
    manifest = out / "_batchjob" / "manifest.jsonl"
    torn = manifest.read_bytes() + b'{"part": {"name": "part-000009.par'
    manifest.write_bytes(torn)
    assert _cli("status", out).exit_code == 0
    assert _cli("export", out, "--format", "jsonl", "--to", tmp_path / "x.jsonl").exit_code == 0
    assert manifest.read_bytes() == torn
    assert run_job(_spec(data, out, tiny_model_dir)).status == "already complete"
