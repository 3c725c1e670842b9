"""batchjob under a real Slurm, on the CPU with the tiny model: the project's own array script through real
time-limit signals and requeues, and ``srun`` tasks stopped by ``scancel``. Each ends with every id exactly
once and the text of an uninterrupted local run.

Needs a Slurm that this user can submit to, with an idle node of at least two CPUs: ``.ci/slurm-up`` starts
one on this machine (root, Debian's slurm-wlm and munge; docs/development.md), and ``.ci/run`` does so.
Without one the tests are skipped, saying why. A task is stopped where the test needs it by a fault point
(``BATCHJOB_FAULT_PAUSE=part_committed``: it waits there for a signal), never after a sleep. With that
Slurm's short requeue delay (``AuthInfo=cred_expire=5``) the array test takes about a minute; on a cluster
with Slurm's defaults, a few.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

from batchjob.job import make_spec, run_job
from tests.faultproc import wait_for_points
from tests.jobproc import read_results, torch_threads

pytestmark = [pytest.mark.cluster, pytest.mark.process, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "array.sbatch"
N_ROWS = 100  # and one torn line; 8 rows at a time, so a worker's first part is a few rows of its 50
FINISHED = {
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "CANCELLED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "DEADLINE",
}
PAUSE = "BATCHJOB_FAULT_PAUSE=part_committed"


def _slurm_missing() -> str | None:
    """Why the tests can't run here, or None."""
    hint = "start one on this machine with `sudo .ci/slurm-up` (docs/development.md)"
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"no Slurm: sinfo/sbatch not on PATH; {hint}"
    try:
        found = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t %c"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return f"no Slurm reachable: sinfo did not answer in 30 s; {hint}"
    if found.returncode != 0:
        error = found.stderr.strip().splitlines()[-1:] or ["no message"]
        return f"no Slurm reachable (sinfo: {error[0]}); {hint} and export SLURM_CONF=/tmp/batchjob-slurm/slurm.conf"
    nodes = [line.split() for line in found.stdout.splitlines() if line.strip()]
    if not any(state == "idle" and int(cpus) >= 2 for state, cpus in nodes):
        return f"no idle Slurm node with 2 CPUs (sinfo: {found.stdout.strip() or 'no nodes'})"
    return None


@pytest.fixture(scope="session", autouse=True)  # before the session's tiny model is built
def slurm():
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)


def slurm_env(**extra: str) -> dict[str, str]:
    """This environment without a surrounding job's SLURM_* variables (srun would join that job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    return dict(env, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)


def slurm_cmd(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, env=slurm_env())
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def job_file(tmp_path_factory, tiny_model_dir):
    """A job file next to its input, on the CPU: seeded sampling, so a resumed job must reproduce an
    uninterrupted one; 8 rows at a time and a checkpoint every 0.2 s, so a worker's first part comes early."""
    folder = tmp_path_factory.mktemp("job")
    with open(folder / "reviews.jsonl", "w") as f:
        for i in range(N_ROWS):
            word = "good" if i % 3 else "bad"
            f.write(json.dumps({"rid": f"r{i:04d}", "review": f"item {i} was {word}", "label": f" {word}"}))
            f.write("\n")
        f.write("{torn json\n")
    path = folder / "job.toml"
    path.write_text(
        'input = "reviews.jsonl"\n'
        f"model = {json.dumps(str(tiny_model_dir))}\n"
        'template = "Review: {review}\\nSentiment:"\n'
        'id-column = "rid"\n'
        "max-new-tokens = 16\n"
        "temperature = 0.9\n"
        "seed = 5\n"
        'device = "cpu"\n'
        "max-num-seqs = 8\n"
        "checkpoint-interval = 0.2\n"
    )
    return path


@pytest.fixture(scope="module")
def score_job_file(job_file, tiny_model_dir):
    """The same rows as a ``score`` task: each label's log-likelihood after its review, in chunks of at
    most 8 tokens (so rows take several steps, beside others), the prefix cache on."""
    path = job_file.parent / "score.toml"
    path.write_text(
        'input = "reviews.jsonl"\n'
        f"model = {json.dumps(str(tiny_model_dir))}\n"
        'template = "Review: {review}\\nSentiment:"\n'
        'id-column = "rid"\n'
        'task = "score"\n'
        'score-column = "label"\n'
        'device = "cpu"\n'
        "max-num-seqs = 8\n"
        "max-num-batched-tokens = 8\n"
        "checkpoint-interval = 0.2\n"
    )
    return path


@pytest.fixture(scope="module")
def score_expected(score_job_file, tmp_path_factory):
    """The score job run here in one go, all rows at once, on one thread as the tasks (``slurm_env``)."""
    out = tmp_path_factory.mktemp("score_ref") / "out"
    with torch_threads(1):
        assert run_job(make_spec(score_job_file, output=str(out), max_num_seqs=64)).status == "complete"
    rows = read_results(out)
    assert len(rows) == N_ROWS + 1 and all(isinstance(r["logprob"], float) for r in rows if not r["error"])
    return rows


@pytest.fixture(scope="module")
def expected(job_file, tmp_path_factory):
    """The same job run here in one go (in large batches: the batch never changes a row's tokens)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert run_job(make_spec(job_file, output=str(out), max_num_seqs=64)).status == "complete"
    rows = read_results(out)
    assert len(rows) == N_ROWS + 1
    return rows


def status(out: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "batchjob", "status", str(out)], capture_output=True, text=True, timeout=120
    )
    return done.stdout + done.stderr


def job_tasks(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job`` of every task of a job, as dictionaries of its fields."""
    tasks = []
    for line in slurm_cmd("scontrol", "-o", "show", "job", job_id).splitlines():
        if line.strip():
            tasks.append(dict(re.findall(r"(\w+)=(\S*)", line)))
    return tasks


def task_environment(folder: Path, out: Path) -> Path:
    """What the array script activates (its ``BATCHJOB_VENV``): this Python's environment, and for a task
    with no part of its own yet, the fault point after its first part: it waits there for Slurm's signal.
    So each task's first attempt that gets to commit rows is stopped mid-job by the time limit, whenever the
    signal comes; the attempts after it run free."""
    activate = Path(sys.prefix) / "bin" / "activate"
    scripts = sysconfig.get_path("scripts")
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text(
        (f". {activate}\n" if activate.exists() else f'export PATH="{scripts}:$PATH"\n')
        + f'mine="{out}/part-$(printf %05d "$SLURM_ARRAY_TASK_ID")-of-00002-*.parquet"\n'
        + f'compgen -G "$mine" >/dev/null || export {PAUSE}\n'
    )
    return folder


def test_array_script_through_time_limits_and_requeues(job_file, expected, tmp_path):
    """``examples/slurm/array.sbatch`` as it is, as a 2-task array with a 1-minute time limit and the signal
    5 s ahead: Slurm signals each task 25-55 s after it starts (it looks every 30 s, and may be up to 30 s
    early), the task saves its state and exits 75, the script requeues it, and it resumes and finishes."""
    out = tmp_path / "out"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = task_environment(tmp_path / "env", out)
    sbatch = [
        "sbatch",
        "--parsable",
        "--array=0-1",
        "--time=1",
        "--signal=B:TERM@5",
        "--cpus-per-task=1",
        "--mem=1G",
        # not ALL: the task starts from the login environment (as with --export=NONE) and the script
        # activates BATCHJOB_VENV
        f"--export=BATCHJOB_VENV={env},OMP_NUM_THREADS=1,HF_HUB_OFFLINE=1",
        f"--chdir={tmp_path}",
        f"--output={logs}/%x-%A_%a.out",
        str(SCRIPT),
        str(job_file),
        str(out),
    ]
    started = time.monotonic()
    job_id = slurm_cmd(*sbatch).strip().split(";")[0]
    try:
        deadline = started + 480
        while True:
            tasks = job_tasks(job_id)
            if len(tasks) == 2 and all(t["JobState"] in FINISHED for t in tasks):
                break
            assert time.monotonic() < deadline, f"array job {job_id} not done after 480 s: {tasks}"
            time.sleep(1)  # polling Slurm's view of the job, not waiting for something to happen
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env(), timeout=60)
    took = time.monotonic() - started
    text = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))

    for task in tasks:
        assert task["JobState"] == "COMPLETED" and task["ExitCode"] == "0:0", f"{task}\n{text}"
        # the time limit stopped it at least once, and it was requeued and resumed
        assert int(task["Restarts"]) >= 1, f"task {task['ArrayTaskId']} finished before its signal\n{text}"
    assert len(list(logs.iterdir())) == 2, text
    for log in sorted(logs.iterdir()):
        body = log.read_text()
        assert "fault point part_committed" in body, text
        # the lines the script's header explains: Slurm's "CANCELLED" at the signal, then the script's own
        assert re.search(r"\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+ \*\*\*", body), text
        assert "batchjob: SIGTERM from Slurm, saving state" in body, text
        stopped = [(int(a), int(b)) for a, b in re.findall(r"interrupted: (\d+) of (\d+) rows done", body)]
        assert stopped and all(0 < done < total for done, total in stopped), text  # mid-job, with rows done
        assert "state saved; run the same command again to resume" in body, text
        assert "batchjob: state saved; requeueing" in body, text
        assert re.search(r"complete: \d+ of \d+ rows done", body) and "Traceback" not in body, text
    got = read_results(out)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]  # every id exactly once
    assert got == expected
    report = status(out)
    assert "complete (2 of 2 workers complete)" in report, report
    restarts = sum(int(t["Restarts"]) for t in tasks)
    print(f"array job {job_id}: 2 tasks, {restarts} requeues, done in {took:.0f} s")


def test_srun_tasks_stopped_by_scancel_then_rerun(score_job_file, score_expected, tmp_path):
    """Two ``srun`` tasks of one ``score`` job (shards by SLURM_PROCID/SLURM_NTASKS), each waiting after
    its first part, get SIGTERM from ``scancel --signal=TERM``, save their state and exit 75; the same
    command again finishes the job, bit for bit as a run in one go (the array test runs generation)."""
    job_file, expected = score_job_file, score_expected
    out = tmp_path / "out"
    name = f"batchjob-test-{uuid.uuid4().hex[:8]}"
    srun = ["srun", f"--job-name={name}", "-n", "2", "-c", "1", "--mem=1G", "--time=5", "-l"]
    srun += [sys.executable, "-m", "batchjob", "run", str(job_file), "--output", str(out)]

    def start(**env):
        return subprocess.Popen(
            srun,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=slurm_env(**env),
            cwd=tmp_path,
        )

    proc = start(BATCHJOB_FAULT_PAUSE="part_committed")
    try:
        _, text = wait_for_points(proc, 2)  # both tasks have committed a part and wait for a signal
        job_id = slurm_cmd("squeue", "-h", f"--name={name}", "-o", "%A").strip()
        assert job_id, f"no job named {name} in squeue"
        slurm_cmd("scancel", "--signal=TERM", job_id)
        text += proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, text  # srun exits with its tasks' highest code
    assert "shard 0 of 2 (from SLURM_PROCID/SLURM_NTASKS)" in text and "shard 1 of 2" in text, text
    assert text.count("state saved; run the same command again to resume") == 2, text
    partial = read_results(out)
    assert 0 < len(partial) < len(expected), text
    assert len({r["rid"] for r in partial}) == len(partial)
    assert "incomplete" in status(out)

    proc = start()
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text
    assert text.count("complete:") == 2, text
    got = read_results(out)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]
    assert got == expected
    assert "complete (2 of 2 workers complete)" in status(out)
