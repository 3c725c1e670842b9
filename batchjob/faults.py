"""Fault injection, for tests that drive a real process: stop at a named moment, or fail a write as a full disk
would. Both are read from the environment when the point is reached and cost nothing when unset.

- ``BATCHJOB_FAULT_PAUSE=<point>[,<point>...]``: at that point the process prints
  ``batchjob: fault point <point> (pid N): waiting for a signal`` on stderr, waits until a SIGTERM/SIGINT
  handler has run, and goes on as that handler decides (raise, or set the loop's stop flag). Points:
  ``entry`` (the command's handlers are installed, its imports not done), ``startup`` (the command is about
  to parse its options), ``before_model_load`` and ``during_model_load`` (``run_job``, the state folder
  locked), ``loop_started`` (the job loop's own handlers are in place), ``launch`` (the ``--devices``
  launcher, before it starts a worker), ``worker_started`` (the launcher, after starting its first worker).
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

_writes: dict[str, int] = {}


def point(name: str) -> None:
    """If ``BATCHJOB_FAULT_PAUSE`` names this point, announce it and wait for SIGTERM/SIGINT."""
    if name not in os.environ.get(PAUSE_ENV, "").split(","):
        return
    if threading.current_thread() is not threading.main_thread():
        return
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
        print(
            f"batchjob: fault point {name} (pid {os.getpid()}): waiting for a signal",
            file=sys.stderr,
            flush=True,
        )
        while not got:
            time.sleep(0.02)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
