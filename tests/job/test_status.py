"""``batchjob status``: what it says of a job's progress, read from the output folder alone."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job.shard import Shard
from batchjob.job.status import JobStatus, WorkerStatus
from tests.faultproc import wait_for_points

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("done", "total", "shown"),
    [
        (1999, 2000, "99.9%"),
        (19_999, 20_000, "99.9%"),
        (2000, 2000, "100.0%"),
        (1, 3, "33.3%"),
        (2, 3, "66.6%"),
    ],
)
def test_the_share_done_is_floored_so_an_incomplete_job_is_never_at_100_percent(done, total, shown):
    """1999 of 2000 rows showed '(100.0%)', rounded up: the share is floored to a tenth now."""
    status = JobStatus(Path("out"), [WorkerStatus(Shard(0, 1), "stopped", rows_done=done)], total)
    assert f"rows: {done} of {total} input rows ({shown})" in status.lines("out")


@pytest.mark.process
def test_rows_committed_after_the_live_figures_are_not_counted_twice(launch, tiny_model_dir, tmp_path):
    """A run writes its live figures (stats.json) and then commits the rows they call finished; status added
    them to the committed rows all the same ('rows: 57 of 300' and 'in flight: 57 more rows finished, not yet
    committed'), and, the run killed there, said 'the last run ended without committing 57 rows ... batchjob
    run redoes them' of rows committed. A new run showed the killed run's figures as its own."""
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"r{i}", "review": f"review number {i}"}) + "\n" for i in range(40))
    )
    out = tmp_path / "out"
    args = [
        "--input", data, "--output", out, "--model", tiny_model_dir, "--template", "{review}",
        "--max-new-tokens", "6", "--max-num-seqs", "4", "--checkpoint-interval", "0.001",
    ]  # fmt: skip
    args = [str(a) for a in args]
    proc = launch(args, BATCHJOB_FAULT_PAUSE="part_committed")  # a checkpoint's commit, stats written before
    wait_for_points(proc)
    text = status(out)
    committed = re.search(r"rows: (\d+) of 40 input rows", text)
    assert committed and int(committed.group(1)) > 0, text
    assert "in flight: 0 more rows finished, not yet committed; " in text, text  # the part just took them
    proc.kill()  # as kill -9: nothing saved after the commit
    proc.wait()
    text = status(out)
    assert f"{out}: incomplete\n" in text and "without committing" not in text, text
    again = launch(args, BATCHJOB_FAULT_PAUSE="loop_started")  # its own figures are not written yet
    [pid], _ = wait_for_points(again)
    text = status(out)
    assert f"running now (pid {pid} on " in text and "in flight" not in text, text
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=120) == 75


def status(out) -> str:
    result = CliRunner().invoke(main, ["status", str(out)])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_file_the_job_did_not_write_is_named_and_run_refuses_it(tiny_model_dir, tmp_path):
    """A copy of a part as out/stray.parquet (or a folder of Parquet files) made pyarrow.dataset read 80 rows
    for a job of 60 while run and status said complete: status names it, run refuses it (exit 2)."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"x{i}", "review": f"good {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    args = ["run", "--input", str(data), "--output", str(out), "--model", str(tiny_model_dir)]
    args += ["--template", "{review}", "--id-column", "id", "--max-new-tokens", "2"]
    runner = CliRunner()
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    part = next(out.glob("part-*.parquet"))
    shutil.copy(part, out / "stray.parquet")
    (out / "sub").mkdir()
    shutil.copy(part, out / "sub" / "more.bin")
    assert ds.dataset(out, format="parquet").count_rows() == 18  # what a reader of the folder would get
    result = runner.invoke(main, ["status", str(out)])
    assert result.exit_code == 0, result.output
    assert f"{out}: complete, but {out / 'stray.parquet'}, {out / 'sub'} are not the job's: readers of" in (
        result.output
    )
    result = runner.invoke(main, args)
    assert result.exit_code == 2 and f"holds {out / 'stray.parquet'} and 1 more, which is not the job's" in (
        result.output
    ), result.output
    (out / "stray.parquet").rename(tmp_path / "stray.parquet")
    shutil.rmtree(out / "sub")
    (out / "_mine").mkdir()  # names a dataset reader skips are the user's to keep there
    (out / "notes.txt").write_text("not Parquet: a reader fails on it, loudly")
    (out / "logs").mkdir()  # a folder of no Parquet file (a Slurm task's logs) as well
    (out / "logs" / "task-0.out").write_text("batchjob: shard 0 of 1")
    result = runner.invoke(main, args)
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    result = runner.invoke(main, ["status", str(out)])
    assert f"{out}: complete\n" in result.output, result.output
