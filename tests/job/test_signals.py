"""SIGTERM/SIGINT at any moment of ``batchjob run`` end in exit 75 and a resumable job; a launcher's workers
die with it. Real processes, stopped at named fault points (``BATCHJOB_FAULT_PAUSE``), never by timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from batchjob import signals
from batchjob.job import loop
from tests.faultproc import job_args, reference, temp_files, wait_for_points, wait_gone, write_reviews
from tests.jobproc import launch, run_here
from tests.jobproc import read_results as results

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]  # every test starts processes


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    return write_reviews(tmp_path_factory.mktemp("data") / "reviews.jsonl", 15)


@pytest.fixture(scope="module")
def expected(reviews, tiny_model_dir, tmp_path_factory):
    return reference(reviews, tiny_model_dir, tmp_path_factory.mktemp("ref") / "out")


def console_script(args, **env) -> subprocess.Popen:
    """The installed ``batchjob`` command (not ``python -m``): its handlers come from ``import batchjob``."""
    script = Path(sys.executable).parent / "batchjob"
    if not script.exists():
        pytest.skip("the batchjob console script is not installed next to this python")
    return subprocess.Popen(
        [str(script), "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
    )


def test_importing_the_library_installs_no_handlers():
    # compared with the handlers before the import (a process started in the background by a shell without
    # job control begins with SIGINT ignored)
    code = (
        "import signal; before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]; "
        "import batchjob, batchjob.cli, batchjob.job; "
        "print(*(signal.getsignal(s) is b for s, b in zip((signal.SIGTERM, signal.SIGINT), before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]
    assert signals.EXIT_INTERRUPTED == loop.EXIT_INTERRUPTED == 75


@pytest.mark.parametrize(
    "point, sig, phase, entry",
    [
        ("entry", signal.SIGTERM, "starting", console_script),  # during the imports: acted on at once after
        ("startup", signal.SIGINT, "starting", launch),  # before the options are parsed
        ("before_model_load", signal.SIGTERM, "starting", launch),  # inputs checked, state folder locked
        ("during_model_load", signal.SIGINT, "loading the model", launch),
    ],
)
def test_a_signal_during_start_up_exits_75_and_the_rerun_completes(
    reviews, tiny_model_dir, tmp_path, expected, point, sig, phase, entry
):
    out = tmp_path / "out"
    args = job_args(reviews, out, tiny_model_dir)
    proc = entry(args, BATCHJOB_FAULT_PAUSE=point)
    (pid,), _ = wait_for_points(proc)
    assert pid == proc.pid
    if point == "entry":  # the handlers came before the heavy imports, not after them
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "arrow" not in maps and "torch" not in maps
    proc.send_signal(sig)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, text
    name = signal.Signals(sig).name
    assert (
        f"batchjob: interrupted by {name} during start-up ({phase}); nothing to save; run the same " in text
    )
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    if out.exists():  # at most the state folder: no part, no temporary file
        assert temp_files(out) == [] and not list(out.glob("*.parquet"))

    code, text = run_here(args)  # the rerun, in this process: what the stopped process left is the point
    assert code == 0, text
    assert results(out) == expected  # every row exactly once, the same text


def test_sigkill_to_the_launcher_takes_its_workers_with_it(
    reviews, tiny_model_dir, tmp_path, expected, monkeypatch
):
    out = tmp_path / "out"
    args = ["--devices", "cpu,cpu", *job_args(reviews, out, tiny_model_dir)]
    # both workers stop once their job loop runs (the launcher never gets there)
    launcher = launch(args, BATCHJOB_FAULT_PAUSE="loop_started", OMP_NUM_THREADS="1")
    workers, _ = wait_for_points(launcher, count=2)
    assert launcher.pid not in workers
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert wait_gone(workers, timeout=60) == []  # no orphans
    with launcher.stdout:
        text = launcher.stdout.read()  # the workers held the pipe open until they exited
    assert text.count("is gone; stopping") == 2, text
    assert text.count("state saved; run the same command again") == 2, text
    assert "second signal" not in text and "Traceback" not in text
    for shard in ("shard-00000-of-00002", "shard-00001-of-00002"):
        assert (out / "_batchjob" / shard / "inflight.json").exists()  # each saved its requests

    # the rerun: its launcher in this process (what the stopped one left is the point), its workers processes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, text = run_here(args)
    assert code == 0, text
    assert results(out) == expected


def test_a_signal_to_the_launcher_before_its_workers_run_exits_75(
    reviews, tiny_model_dir, tmp_path, expected, monkeypatch
):
    out = tmp_path / "out"
    args = ["--devices", "cpu,cpu", *job_args(reviews, out, tiny_model_dir)]
    # before any worker: the launcher's own start-up
    proc = launch(args, BATCHJOB_FAULT_PAUSE="launch")
    wait_for_points(proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75 and "during start-up" in text and "Traceback" not in text, text

    # after the first worker started: it gets the signal, the second is never started
    proc = launch(args, BATCHJOB_FAULT_PAUSE="worker_started", OMP_NUM_THREADS="1")
    wait_for_points(proc)
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, text
    assert "worker shard 0 of 2 on cpu: exit 75" in text  # the signal waited for its handlers
    assert "worker shard 1 of 2 on cpu: not started (interrupted)" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text

    # the rerun: its launcher in this process (what the stopped one left is the point), its workers processes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, text = run_here(args)
    assert code == 0, text
    assert results(out) == expected


def test_the_watch_stops_a_worker_whose_parent_died(tmp_path):
    """The portable half (no prctl): a process whose parent exits sends itself SIGTERM."""
    child = (
        "import os, signal, sys; from batchjob import signals; "
        "signals.watch_parent(os.getppid(), interval=0.05); print(os.getpid(), flush=True); signal.pause()"
    )
    parent = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True); "
        "print(p.stdout.readline().strip(), flush=True)"  # the child runs and watches; then we exit
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True).stdout
    assert wait_gone([int(out)], timeout=30) == []


def test_any_number_of_signals_once_the_state_is_saved_exit_75(reviews, tiny_model_dir, tmp_path, expected):
    """A second (third, ...) SIGTERM or SIGINT after "state saved", while the interpreter shuts down and
    Python has put its default handlers back, must not turn exit 75 into 143: a wrapper requeues on 75."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchjob", "run", *job_args(reviews, out, tiny_model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", BATCHJOB_FAULT_PAUSE="loop_started,finalizing"),
    )
    wait_for_points(proc)  # the loop runs
    proc.send_signal(signal.SIGTERM)
    (pid,), text = wait_for_points(proc)  # the state is saved, the interpreter is shutting down
    assert pid == proc.pid and "state saved; run the same command again" in text, text
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        proc.send_signal(sig)
    text += proc.communicate("go\n", timeout=60)[0]  # (without its fix, the process is dead by now)
    assert proc.returncode == 75, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert (out / "_batchjob" / "inflight.json").exists()

    code, text = run_here(job_args(reviews, out, tiny_model_dir))  # the rerun, in this process
    assert code == 0, text
    assert results(out) == expected
