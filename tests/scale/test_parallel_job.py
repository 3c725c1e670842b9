"""``batchjob run --tensor-parallel-size 2`` as real processes on CPU (gloo): the output equals a TP 1 run
(float64); a rank SIGKILLed mid-job stops the job within seconds naming the rank, and the rerun resumes
exactly; SIGTERM saves the state (exit 75) and the rerun resumes exactly; ``--devices`` x TP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from click.testing import CliRunner

from batchjob.cli import main
from tests.faultproc import alive, job_args, wait_for_points, wait_gone, write_reviews
from tests.jobproc import launch as launch_run
from tests.jobproc import read_results, run_here
from tests.tiers import engine_fixture

pytestmark = [pytest.mark.timeout(600), pytest.mark.process]  # real jobs with their rank processes

N_ROWS = 20


def launch(args, **env):
    return launch_run(args, OMP_NUM_THREADS="1", **env)


def tp_args(reviews, out, model, *extra):
    return job_args(reviews, out, model, "--dtype", "float64", "--checkpoint-interval", "0.1", *extra)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    return write_reviews(tmp_path_factory.mktemp("data") / "reviews.jsonl", N_ROWS)


@engine_fixture(scope="module")
def expected(reviews, tiny_model_dir, tmp_path_factory):
    """A TP 1 run of the job, in this process (a reference: no process start-up to pay for)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    code, text = run_here(tp_args(reviews, out, tiny_model_dir))
    assert code == 0, text
    return read_results(out)


def rerun(args, monkeypatch):
    """The same command again, its rank 0 (or launcher) in this process: what the stopped job left on disk is
    the point. Its other ranks and workers are processes, one thread each as ``launch``'s."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, text = run_here(args)
    assert not dist.is_initialized()  # the job's process group is gone with it
    return code, text


def test_a_killed_rank_stops_the_job_naming_it_and_the_rerun_is_exact(
    reviews, tiny_model_dir, tmp_path, expected, monkeypatch
):
    out = tmp_path / "out"
    args = tp_args(reviews, out, tiny_model_dir, "--tensor-parallel-size", "2")
    proc = launch(args, BATCHJOB_FAULT_PAUSE="tp_rank1_step30")
    (rank1,), _ = wait_for_points(proc)  # rank 1 waits before its 30th forward: the job is under way
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    text = proc.communicate(timeout=120)[0]
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1, text
    assert f"tensor-parallel rank 1 (pid {rank1}) died (killed by signal 9)" in text
    assert "Run the same command again to resume" in text and "Traceback" not in text
    done = read_results(out) if any(out.glob("*.parquet")) else []
    assert 0 < len(done) < len(expected), "the rank was meant to die mid-job, after some rows were written"

    code, text = rerun(args, monkeypatch)
    assert code == 0, text
    assert read_results(out) == expected  # TP 2 (resumed) writes what TP 1 wrote


def test_sigterm_saves_the_state_stops_every_rank_and_resumes_exactly(
    reviews, tiny_model_dir, tmp_path, expected, monkeypatch
):
    out = tmp_path / "out"
    args = tp_args(reviews, out, tiny_model_dir, "--tensor-parallel-size", "2")
    proc = launch(args, BATCHJOB_FAULT_PAUSE="part_committed")
    (pid,), _ = wait_for_points(proc)
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert children, "rank 0 was meant to have started rank 1"
    proc.send_signal(signal.SIGTERM)
    # ~3 s alone; two ranks on an oversubscribed 2-core machine can take far longer (bounded all the same)
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, text
    assert wait_gone(children, 10) == [], "rank 1 outlived its job"
    assert not any(alive(c) for c in children)

    code, text = rerun(args, monkeypatch)
    assert code == 0, text
    assert read_results(out) == expected


def test_devices_times_tensor_parallel_size(reviews, tiny_model_dir, tmp_path, expected, monkeypatch):
    """Four CPU devices, two ranks each: two workers, each one shard of the job."""
    out = tmp_path / "out"
    args = tp_args(
        reviews, out, tiny_model_dir, "--tensor-parallel-size", "2", "--devices", "cpu,cpu,cpu,cpu"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, text = run_here(args)  # the launcher in this process; its two workers and their ranks processes
    assert code == 0, text
    assert text.count("worker shard") == 2 or text.count(": exit 0") == 2, text
    assert read_results(out) == expected

    bad = tp_args(
        reviews, tmp_path / "bad", tiny_model_dir, "--tensor-parallel-size", "2", "--devices", "cpu,cpu,cpu"
    )
    result = CliRunner().invoke(main, ["run", *bad])
    assert result.exit_code == 2
    assert "--devices lists 3 devices, not a multiple of --tensor-parallel-size 2" in result.output
