"""Helpers for tests that run ``batchjob run`` as a real process and read what it wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

import pyarrow.dataset as ds


def read_results(out) -> list[dict]:
    """Every result row under ``out``, sorted by id (error rows without an id last, by their error)."""
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["rid"] is None, r["rid"] or "", r["error"] or ""))


def launch(args, **env) -> subprocess.Popen:
    """``python -m batchjob run ARGS`` in a new process (offline; ``env`` added to the environment). Tests take
    it as the ``launch`` fixture (tests/conftest.py), which puts them in the process tier."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchjob", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
    )


def run_here(args) -> tuple[int, str]:
    """``batchjob run ARGS`` in this process (click's ``CliRunner``): its exit code and output, stderr included.
    For the runs whose point is what is on disk (a reference, a rerun that resumes), not the process: it costs
    no interpreter start-up, which is most of a small job's time."""
    from click.testing import CliRunner

    from batchjob.cli import main

    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


@contextmanager
def at_step(n: int, action):
    """Within the block, ``action()`` runs in this process just before the engine's n-th step: something
    done to a job at a known point of its run (a signal, another worker's run), not after a sleep."""
    from batchjob.engine import Engine

    step, count = Engine.step, [0]

    def acting_step(self):
        count[0] += 1
        if count[0] == n:
            action()
        return step(self)

    Engine.step = acting_step
    try:
        yield
    finally:
        Engine.step = step


@contextmanager
def sigterm_after_steps(n: int):
    """Within the block, this process gets SIGTERM at the engine's n-th step (an in-process job then
    checkpoints and stops with exit 75): an interruption at a known point, not after a sleep."""
    with at_step(n, lambda: os.kill(os.getpid(), signal.SIGTERM)):
        yield


@contextmanager
def torch_threads(n: int):
    """torch's thread count set to ``n`` inside: a reference run in this process for workers started with
    ``OMP_NUM_THREADS=n`` (a float sum may be split otherwise over another number of threads, so the
    last bits of a task's values can differ between thread counts, as they can between machines)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
