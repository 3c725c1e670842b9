"""Fault injection, for tests that drive a real process: stop or die at a named moment, fail a write as a full
disk would, fail a read as a flaky disk or network would. All are read from the environment when the point is
reached and cost nothing when unset.

- ``BATCHJOB_FAULT_PAUSE=<point>[,<point>...]``: at that point the process prints
  ``batchjob: fault point <point> (pid N): waiting for a signal`` on stderr, waits until a SIGTERM/SIGINT
  handler has run, and goes on as that handler decides (raise, or set the loop's stop flag). Points:
  ``entry`` (the command's handlers are installed, its imports not done), ``startup`` (the command is about
  to parse its options), ``before_model_load`` and ``during_model_load`` (``run_job``, the state folder
  locked), ``loop_started`` (the job loop's own handlers are in place), ``launch`` (the ``--devices``
  launcher, before it starts a worker), ``worker_started`` (the launcher, after starting its first worker),
  ``part_committed`` (the job loop, after a part is listed in the manifest), ``tp_rank<r>_step<n>``
  (tensor-parallel rank r > 0, before the forward of its n-th step; it ignores SIGTERM otherwise). And ``finalizing``: the command
  is over and the interpreter shutting down (its signal handlers gone); the process announces it and waits
  for a line on stdin instead (``at_exit``).
- ``BATCHJOB_FAULT_KILL=<point>``: at that point the process dies as if killed (exit 137, nothing flushed or
  cleaned up). Points: ``after_part_rewrite`` and ``after_manifest_rewrite`` (``verify.py``), ``ray_task<i>``
  (the Ray task of shard i, as it starts: on every try, so Ray's retries run out).
- ``BATCHJOB_FAULT_TRUNCATE=<point>:<bytes>:<path>``: when the process reaches that point (any of the pause
  points above) the first time, the file at ``path`` is cut to ``bytes`` in place, as logrotate's
  ``copytruncate`` does to a log a job is reading; the process goes on at once.
- ``BATCHJOB_FAULT_EIO=<source name>:<line>``: reading that line of that JSONL input fails with EIO (a
  transient read error: the rest of the file becomes one error row, which ``--retry-errors`` redoes).
- ``BATCHJOB_FAULT_ENOSPC=<what>:<n>``: the n-th write of ``what`` in this process fails with ENOSPC, the way
  pyarrow reports it (no file name). ``what``: ``part``, or a state file's name (``inflight.json``,
  ``stats.json``, ``job.json``).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from typing import Any

PAUSE_ENV = "BATCHJOB_FAULT_PAUSE"
ENOSPC_ENV = "BATCHJOB_FAULT_ENOSPC"
KILL_ENV = "BATCHJOB_FAULT_KILL"
EIO_ENV = "BATCHJOB_FAULT_EIO"
TRUNCATE_ENV = "BATCHJOB_FAULT_TRUNCATE"

_writes: dict[str, int] = {}
_paused: set[str] = set()  # the points this process has paused at: each pauses once
_truncated: set[str] = set()  # the points at which this process has cut a file: each cuts once


def _truncate(name: str) -> None:
    """If ``BATCHJOB_FAULT_TRUNCATE`` names this point, cut its file in place (the first time only)."""
    target, _, rest = os.environ.get(TRUNCATE_ENV, "").partition(":")
    if target != name or name in _truncated:
        return
    _truncated.add(name)
    size, _, path = rest.partition(":")
    os.truncate(path, int(size))


def point(name: str) -> None:
    """If ``BATCHJOB_FAULT_PAUSE`` names this point, announce it and wait for SIGTERM/SIGINT: the first time the
    process reaches it only. (A test sends one signal; the stop it causes may pass the point again, e.g. the
    last checkpoint's commit, and must not wait there for a second.) ``BATCHJOB_FAULT_TRUNCATE`` acts here too."""
    _truncate(name)
    if name not in os.environ.get(PAUSE_ENV, "").split(","):
        return
    if threading.current_thread() is not threading.main_thread() or name in _paused:
        return
    _paused.add(name)
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in signals}
    got: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        for s, h in previous.items():
            signal.signal(s, h)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # its default action, now that it is restored

    for s in signals:
        signal.signal(s, on_signal)
    try:  # the handler is in place before the line: a signal sent on reading it is never missed
        # One write of the whole line: print() writes the text and its newline apart, and two workers
        # announcing at once on a shared pipe made one line of two announcements.
        sys.stderr.flush()
        os.write(2, f"batchjob: fault point {name} (pid {os.getpid()}): waiting for a signal\n".encode())
        while not got:
            time.sleep(0.02)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _ExitPoint:
    """Held by this module until the interpreter clears it at shutdown, after Python has put the default
    signal handlers back: the last moment a signal could change the exit code. There it announces the point
    and waits for a line on stdin (no handler can run any more, so the test sends its signals, then the
    line)."""

    def __init__(self, name: str) -> None:
        self.name, self.pid, self.write, self.read = name, os.getpid(), os.write, os.read

    def __del__(self) -> None:
        self.write(2, f"batchjob: fault point {self.name} (pid {self.pid}): waiting for a line\n".encode())
        self.read(0, 1)


_exit_point: _ExitPoint | None = None


def at_exit(name: str) -> None:
    """If ``BATCHJOB_FAULT_PAUSE`` names this point, stop there while the interpreter shuts down."""
    global _exit_point
    if name in os.environ.get(PAUSE_ENV, "").split(","):
        _exit_point = _ExitPoint(name)


def disk_write(what: str) -> None:
    """If ``BATCHJOB_FAULT_ENOSPC`` is ``<what>:<n>`` and this is the n-th such write, fail as a full disk."""
    spec = os.environ.get(ENOSPC_ENV)
    if not spec:
        return
    target, _, n = spec.rpartition(":")
    if target != what:
        return
    _writes[what] = _writes.get(what, 0) + 1
    if str(_writes[what]) == n.strip():
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")


def die(name: str) -> None:
    """If ``BATCHJOB_FAULT_KILL`` names this point, die here as if killed."""
    if os.environ.get(KILL_ENV) == name:
        os._exit(137)


def read_error_line(source_name: str) -> int | None:
    """The line of ``source_name`` whose read is to fail (``BATCHJOB_FAULT_EIO``)."""
    target, _, line = os.environ.get(EIO_ENV, "").rpartition(":")
    return int(line) if target and target == source_name else None
