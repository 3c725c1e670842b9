"""SIGTERM/SIGINT for the ``batchjob`` command from its first instant: whenever a signal comes, the process
exits 75 ("run the same command again"), with its state saved if it has any.

The command's handlers go through three stages:

- from the entry point until the command runs (imports, option parsing): a signal is remembered, and acted
  on as soon as the command starts (``arm``);
- during start-up (input checks, loading the model): the handler raises ``Interrupted``. It unwinds like
  any exception (the state folder's lock is released; state files are only ever replaced atomically, so
  none is left half written) and the entry point turns it into one line and exit 75;
- while the job loop runs, the loop's own handler (``handling``, from ``runner.run_job``) has it checkpoint
  and stop;
  after the loop (``finishing``) a signal is only noted: the process is already on its way out;
- once the command is over (``quiet``), signals are ignored, through the interpreter's shutdown: any number
  of SIGTERM/SIGINT at any moment leave the exit code the command decided (75 once its state is saved).

Only the command-line entry point installs these handlers; importing the library (or calling ``run_job``
from Python) never does. This module imports nothing heavy, so the entry point installs them before torch,
transformers or pyarrow are imported.

A worker started by ``--devices`` holds SIGTERM/SIGINT blocked from its fork until its handlers are installed,
so a signal that reaches it while it starts is acted on, not lost. It also stops when its launcher dies, even
by SIGKILL: from its fork until its handlers are installed the kernel covers it (``PR_SET_PDEATHSIG``, Linux);
from then on a watch thread (``watch_parent``, any OS) sends it one SIGTERM as soon as its parent is no
longer the launcher. It saves its state and exits 75, and a rerun resumes. (The kernel's signal is not kept
for the whole run because it fires each time the launcher *thread* that forked the worker exits: a dying
launcher with several threads would deliver it several times, which reads as "second signal".)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

EXIT_INTERRUPTED = 75  # the same code as batchjob.job.loop.EXIT_INTERRUPTED (that module imports pyarrow)
SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_ENV = "BATCHJOB_PARENT_PID"  # set by the --devices launcher for its workers: the launcher's pid
_PR_SET_PDEATHSIG = 1

_installed = False
_stage = "deferred"  # "deferred" | "start-up" | "finishing"
_pending: int | None = None  # a signal that came while deferred
_phase = "starting"  # what start-up is doing, for the message


class Interrupted(BaseException):
    """SIGTERM/SIGINT during start-up. A BaseException, like KeyboardInterrupt, so that no ``except
    Exception`` on the way (in a model loader, say) swallows it."""

    def __init__(self, signum: int, phase: str) -> None:
        super().__init__(signum, phase)
        self.signum = signum
        self.phase = phase

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return (
            f"interrupted by {name} during start-up ({self.phase}); nothing to save; "
            "run the same command again"
        )


def started_as_command() -> bool:
    """Whether this process is the ``batchjob`` console script (its main module is a file of that name)."""
    main = sys.modules.get("__main__")
    return os.path.basename(getattr(main, "__file__", None) or "") in ("batchjob", "batchjob.exe")


def install() -> None:
    """Install the command's handlers: the entry point's first act. Idempotent; main thread only."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _handle)
    _installed = True
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        # The kernel's PR_SET_PDEATHSIG (set by the launcher) covers us until here; it fires each time the
        # launcher thread that started us exits, so a dying multi-threaded launcher would send it several
        # times. From now on the watch sends exactly one SIGTERM when the launcher process is gone.
        _set_pdeathsig(0)
        watch_parent(int(parent))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # blocked by worker_preexec until now
    from batchjob import faults

    faults.point("entry")


def _handle(signum: int, frame: Any) -> None:
    global _pending, _stage
    if _stage == "deferred":
        _pending = signum
    elif _stage == "finishing":
        print(f"batchjob: {signal.Signals(signum).name} while finishing; exiting", file=sys.stderr)
    else:
        _stage = "finishing"  # a second signal must not interrupt the unwinding of the first
        raise Interrupted(signum, _phase)


def arm() -> None:
    """From now on a signal raises Interrupted; one that came earlier raises it at once."""
    global _stage, _pending
    _stage = "start-up"
    if _pending is not None:
        signum, _pending, _stage = _pending, None, "finishing"
        raise Interrupted(signum, _phase)


def release() -> None:
    """Give the signals back to Python's defaults (commands other than ``run`` keep their usual Ctrl-C)."""
    global _installed
    if not _installed:
        return
    arm()  # a signal already received still stops the process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _installed = False


def quiet() -> None:
    """The command is done (its state saved, or it never had any) and the process is about to exit: from now
    on SIGTERM/SIGINT are ignored. Python puts the default handlers back while the interpreter shuts down
    (which can take a while with torch loaded), and a signal then would end the process with 143 instead of
    the exit code it has decided on; an ignored signal is dropped, so any number of them changes nothing."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def finishing() -> None:
    """The job loop is over (its state saved or complete): a signal now is only noted."""
    global _stage
    if _installed:
        _stage = "finishing"


@contextmanager
def handling(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """While inside, SIGTERM/SIGINT call ``handler`` (in the main thread, which alone gets signals; elsewhere
    nothing changes). On the way out a signal is only noted (``finishing``) and the handlers from before are
    back. The job loop (checkpoint and stop), the ``--devices`` launcher (pass it on) and the Ray launcher
    (cancel the tasks) each stop this way."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        finishing()
        for sig, before in previous.items():
            signal.signal(sig, before)


@contextmanager
def phase(what: str) -> Iterator[None]:
    """Name what start-up is doing, for the message (``loading the model``)."""
    global _phase
    before, _phase = _phase, what
    try:
        yield
    finally:
        _phase = before


# -- a worker outlives no launcher -------------------------------------------------------------------------


def worker_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for a launcher's worker: SIGTERM/SIGINT stay blocked until its handlers are installed
    (then they are delivered: a signal sent to a worker that is still starting is not lost, and never ends
    it with a traceback), and on Linux the kernel sends it SIGTERM if the launcher dies before that."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        with suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # kept across exec, undone by install()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the launcher died before prctl took effect: nobody will send it
                os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _set_pdeathsig(signum: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)


def watch_parent(parent: int, interval: float = 0.2) -> threading.Thread:
    """A daemon thread that sends this process SIGTERM once ``parent`` is no longer its parent."""

    def watch() -> None:
        stop = threading.Event()
        while os.getppid() == parent:
            stop.wait(interval)
        print(f"batchjob: the launcher (pid {parent}) is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="batchjob-parent-watch", daemon=True)
    thread.start()
    return thread
