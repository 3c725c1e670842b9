"""Several real workers of one job sharing one output folder: by flags, as a Slurm array (env), by --devices.

Each compares the combined output with a single worker's: every id exactly once, the same text.
"""

from __future__ import annotations

import functools
import json
import signal

import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job import make_spec, run_job
from tests.faultproc import wait_for_points
from tests.jobproc import at_step, torch_threads
from tests.jobproc import read_results as results

pytestmark = pytest.mark.timeout(300)

N_ROWS = 23  # and one torn line: 24 rows


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "reviews.jsonl"
    with open(path, "w") as f:
        for i in range(N_ROWS):
            f.write(
                json.dumps({"rid": f"r{i:02d}", "review": f"item {i} was {'good' if i % 3 else 'bad'}"})
                + "\n"
            )
        f.write("{torn json\n")
    return path


def job_args(reviews, out, model, *extra):
    args = [
        "--input",
        reviews,
        "--output",
        out,
        "--model",
        model,
        "--template",
        "Review: {review}\nSentiment:",
    ]
    args += ["--id-column", "rid", "--max-new-tokens", "6", "--temperature", "0.9", "--seed", "5"]
    return [str(a) for a in [*args, "--max-num-seqs", "2", "--checkpoint-interval", "0.1", *extra]]


@pytest.fixture(scope="module")
def expected(reviews, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    spec = make_spec(
        input=[str(reviews)],
        output=str(out),
        model=str(tiny_model_dir),
        template="Review: {review}\nSentiment:",
        id_column="rid",
        max_new_tokens=6,
        temperature=0.9,
        seed=5,
    )
    assert run_job(spec).status == "complete"
    return results(out)


@pytest.fixture
def launch(launch):
    """The ``launch`` fixture with one thread per process: three workers on a small machine otherwise spend
    their time contending."""
    return functools.partial(launch, OMP_NUM_THREADS="1")


def finish(procs, timeout=240):
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text
    return outputs


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def test_three_workers_by_flags_equal_one_worker(launch, reviews, tiny_model_dir, tmp_path, expected):
    out = tmp_path / "out"
    args = job_args(reviews, out, tiny_model_dir)
    procs = [launch([*args, "--num-shards", "3", "--shard-index", str(i)]) for i in range(3)]
    outputs = finish(procs)
    assert all("Traceback" not in text for text in outputs)
    got = results(out)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]  # every id exactly once
    assert got == expected
    parts = sorted(p.name for p in out.glob("*.parquet"))
    assert {p.split("-of-")[0] for p in parts} == {"part-00000", "part-00001", "part-00002"}
    body = json.loads((out / "_batchjob" / "job.json").read_text())["body"]
    assert (
        set(body["fingerprint"]) == {"model", "prompt", "sampling", "sharding", "kernels"}
        and len(body["inputs"]) == 1
    )

    code, text = invoke("status", out)
    assert code == 0 and "complete (3 of 3 workers complete)" in text, text
    assert f"rows: {N_ROWS + 1} of {N_ROWS + 1}" in text and "errors: 1" in text
    assert "shard 0 of 3: complete, 8 of 8 rows" in text and "shard 2 of 3: complete" in text
    assert "tok/s" in text

    # a worker with other settings is refused before any work, naming the difference
    code, text = invoke(
        "run", *job_args(reviews, out, tiny_model_dir, "--num-shards", "2", "--shard-index", "0")
    )
    assert code == 2 and "sharding.num_shards: was 3, now 2" in text
    code, text = invoke(
        "run",
        *job_args(reviews, out, tiny_model_dir, "--num-shards", "3", "--shard-index", "1", "--seed", "6"),
    )
    assert code == 2 and "sampling.seed: was 5, now 6" in text
    code, text = invoke(
        "run", *job_args(reviews, out, tiny_model_dir, "--num-shards", "3", "--shard-index", "1")
    )
    assert code == 0 and "already complete" in text


def test_slurm_array_with_a_killed_and_restarted_worker(launch, reviews, tiny_model_dir, tmp_path, expected):
    out = tmp_path / "out"
    args = job_args(reviews, out, tiny_model_dir)

    def array_task(i, count=3, **extra):
        env = {"SLURM_ARRAY_TASK_ID": str(10 + i), "SLURM_ARRAY_TASK_COUNT": str(count)}
        return launch(args, SLURM_ARRAY_TASK_MIN="10", SLURM_ARRAY_JOB_ID="77", **env, **extra)

    # the victim stops after committing its first part (a fault point), then is killed there
    victim = array_task(1, BATCHJOB_FAULT_PAUSE="part_committed")
    procs = [array_task(0), victim, array_task(2)]
    wait_for_points(victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    finish([procs[0], procs[2]])
    code, text = invoke("status", out)
    assert code == 0 and "incomplete (2 of 3 workers complete)" in text and "shard 1 of 3: stopped" in text
    assert f"of {N_ROWS + 1}" in text

    text = finish([array_task(1)])[0]  # the restarted array task resumes its own share only
    assert "shard 1 of 3 (from SLURM_ARRAY_TASK_ID" in text
    assert results(out) == expected
    code, text = invoke("status", out)
    assert code == 0 and "complete (3 of 3 workers complete)" in text


def test_max_errors_looks_at_the_other_workers_once_more_before_completing(
    launch, reviews, tiny_model_dir, tmp_path, expected
):
    """--max-errors counts the job: a worker about to complete looks at the failed rows the others committed
    since its last look. Worker 0 (no failed row of its own, no checkpoint after its start) runs in this
    process; at its first step worker 1 runs to the end as a process and commits its share's failed row (the
    torn line). Without that last look worker 0 would mark its share complete over a job with 1 failed row at
    --max-errors 1."""
    out = tmp_path / "out"
    args = job_args(reviews, out, tiny_model_dir, "--num-shards", "2", "--checkpoint-interval", "3600")
    other = []

    def worker_1_runs():
        other.append(finish([launch([*args, "--shard-index", "1"])])[0])

    with at_step(1, worker_1_runs):
        code, text = invoke("run", *args, "--shard-index", "0", "--max-errors", "1")
    assert other and "complete: 12 of 12 rows done (1 errors)" in other[0], other
    assert (
        code == 1 and "stopped after 1 failed rows in the job (0 in this worker's share, 1 in the" in text
    ), text
    code, text = invoke("status", out)
    assert "shard 0 of 2: stopped, 12 of 12 rows, 0 errors" in text and "shard 1 of 2: complete" in text, text
    code, text = invoke("run", *args, "--shard-index", "0")  # without the limit it completes, as committed
    assert code == 0 and "already complete" not in text, text
    assert results(out) == expected


@pytest.mark.process  # its launcher runs here, its workers are processes
def test_devices_starts_one_worker_per_device(reviews, tiny_model_dir, tmp_path, expected, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as ``launch``'s: the workers inherit it
    # the launcher in this process (one interpreter start fewer), its two workers processes
    code, text = invoke("run", "--devices", "cpu,cpu", *job_args(reviews, out, tiny_model_dir))
    assert code == 0, text
    assert "worker shard 0 of 2 on cpu: exit 0" in text and "worker shard 1 of 2 on cpu: exit 0" in text
    assert results(out) == expected
    code, text = invoke("status", out)
    assert code == 0 and "complete (2 of 2 workers complete)" in text
    code, text = invoke("run", "--devices", "cpu,tpu", *job_args(reviews, out, tiny_model_dir))
    assert code == 2 and "'tpu' is not a device" in text


def embed_args(reviews, out, model):
    """The rows as an ``embed`` task (mean pooling) in chunks of 8 tokens, two rows at a time."""
    args = ["--input", reviews, "--output", out, "--model", model, "--template", "Review: {review}"]
    args += ["--id-column", "rid", "--task", "embed", "--pooling", "mean", "--max-num-batched-tokens", "8"]
    return [str(a) for a in [*args, "--max-num-seqs", "2", "--checkpoint-interval", "0.1"]]


@pytest.mark.ray
@pytest.mark.parametrize("task", ["generate", "embed"])
def test_ray_tasks_on_a_local_instance_resume_and_status(
    launch, reviews, tiny_model_dir, tmp_path, expected, task
):
    pytest.importorskip("ray")
    out = tmp_path / "out"
    args = job_args if task == "generate" else embed_args
    if task == "embed":  # the reference: in one go, in this process, on one thread as the workers
        with torch_threads(1):
            code, text = invoke("run", *embed_args(reviews, tmp_path / "ref", tiny_model_dir))
        assert code == 0, text
        expected = results(tmp_path / "ref")
        assert len(expected[0]["embedding"]) == 64
    # a first run that stops after one worker: --num-shards 3 on a 2-CPU local instance, the rest resumes
    proc = launch(["--ray", "--num-shards", "3", *args(reviews, out, tiny_model_dir)], RAY_ADDRESS="")
    text = finish([proc])[0]
    assert "3 workers as Ray tasks" in text and "shard 2 of 3: complete" in text
    assert results(out) == expected
    code, text = invoke("status", out)
    assert code == 0 and "complete (3 of 3 workers complete)" in text
    # run again without --num-shards: the saved split is kept, and every shard says it is done
    proc = launch(["--ray", *args(reviews, out, tiny_model_dir)], RAY_ADDRESS="")
    text = finish([proc])[0]
    assert "3 workers as Ray tasks" in text and text.count("already complete") == 3


@pytest.mark.ray
def test_a_ray_task_that_crashes_on_every_try_fails_its_shard_alone(
    launch, reviews, tiny_model_dir, tmp_path, expected
):
    """Shard 0's Ray worker dies as it starts, each of Ray's 4 tries: the launcher says so for that shard and
    exits 1 without a traceback, and shard 1 finishes (``ray.shutdown()`` killed it half done); a rerun does
    the rest."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    args = ["--ray", "--num-shards", "2", *job_args(reviews, out, tiny_model_dir)]
    proc = launch(args, RAY_ADDRESS="", BATCHJOB_FAULT_KILL="ray_task0")
    text = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert "batchjob: shard 0 of 2: WorkerCrashedError" in text and "run again to resume" in text, text
    assert "batchjob: shard 1 of 2: complete" in text, text
    code, text = invoke("status", out)
    assert "shard 1 of 2: complete" in text and "shard 0 of 2: not started" in text, text
    text = finish([launch(args, RAY_ADDRESS="")])[0]
    assert "shard 0 of 2: complete" in text and "shard 1 of 2: already complete" in text
    assert results(out) == expected
