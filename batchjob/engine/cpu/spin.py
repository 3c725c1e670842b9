"""Keeps OpenMP's waiting threads from starving the working ones while other programs share our CPUs.

torch's OpenMP runtime on Linux (libgomp) lets a thread that has finished its share of a parallel region
spin for a while (``GOMP_SPINCOUNT``, 300,000 iterations by default) before it sleeps, so that the next
region starts at once. On idle cores that is what makes our many small regions fast: with a short spin the
same run was ~20% slower here. When another program wants the same cores, the spinning threads hold cores
that the thread with work needs, and every region waits for a thread the OS has parked: on the 2-core
machine a job that took 7 s took 70 s next to two busy processes. libgomp documents that it spins only
briefly (1,000 iterations) while it manages more threads than there are CPUs. So while other programs use
our CPUs, :class:`SpinGuard` keeps a parked helper thread that owns an OpenMP team of its own, which puts
the count over; once the CPUs are ours again it lets the helper go, and the long spin is back.

"Other programs" is measured, about once a second, from ``/proc/stat`` (busy time of the CPUs we may run
on, hypervisor steal included) minus our own process's CPU time. Linux only; elsewhere, or when torch's
OpenMP runtime is not libgomp, the guard does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0  # seconds between two readings of the CPU counters
BUSY_OTHERS = 0.25  # CPUs' worth of other programs' work that turns the short spin on
CALM_CHECKS = 5  # readings in a row under that before it turns off again


def busy_ticks(stat_text: str, cpus: set[int]) -> int:
    """Busy clock ticks since boot (all but idle and iowait; steal counts as busy) of ``cpus``."""
    busy = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def own_ticks(self_stat_text: str) -> int:
    """User plus system clock ticks of this process, from ``/proc/self/stat``."""
    fields = self_stat_text.rsplit(")", 1)[1].split()  # fields from the 3rd (state) on
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _libgomp_loaded() -> bool:
    try:
        return "libgomp" in _read("/proc/self/maps")
    except OSError:
        return False


def _park(release: threading.Event) -> None:
    # One parallel region with torch's threads gives this thread an OpenMP team, held until it exits.
    torch.ones(1 << 17).mul_(2)
    release.wait()


class SpinGuard:
    """Call :meth:`check` between steps; :meth:`release` when the engine goes idle."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cpu" and torch.get_num_threads() > 1 and _libgomp_loaded()
        try:
            self.cpus = os.sched_getaffinity(0) if self.enabled else set()
            self._tick_hz = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        except (AttributeError, OSError, ValueError):
            self.enabled = False
        self._last: tuple[float, int, int] | None = None
        self._calm = 0
        self._busy = False  # the last reading's verdict
        self._release: threading.Event | None = None
        self.times_on = 0  # how often the short spin was turned on (for tests and stats)
        self.check()  # the first reading: by the first step (after loading) there is a window to judge

    @property
    def on(self) -> bool:
        return self._release is not None

    def check(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < CHECK_INTERVAL_S:
            if self._busy and not self.on:  # back from idle within a window: the last verdict holds
                self._hold()
            return
        try:
            busy, own = busy_ticks(_read("/proc/stat"), self.cpus), own_ticks(_read("/proc/self/stat"))
        except (OSError, ValueError, IndexError) as e:
            log.debug("CPU counters unreadable, spin guard off: %s", e)
            self.enabled = False
            self.release()
            return
        if self._last is not None:
            t0, busy0, own0 = self._last
            others = ((busy - busy0) - (own - own0)) / (self._tick_hz * (now - t0))
            self.observe(others)
        self._last = (now, busy, own)

    def observe(self, others: float) -> None:
        """Act on one reading: ``others`` CPUs' worth of other programs' work since the last one."""
        self._busy = others > BUSY_OTHERS
        if self._busy:
            self._calm = 0
            self._hold()
        else:
            self._calm += 1
            if self._calm >= CALM_CHECKS:
                self.release()

    def _hold(self) -> None:
        if not self.on:
            self._release = threading.Event()
            threading.Thread(
                target=_park, args=(self._release,), name="batchjob-spin-guard", daemon=True
            ).start()
            self.times_on += 1

    def release(self) -> None:
        """Let the helper go: the long spin is back. The readings go on, so the next check judges the
        time in between (other programs busy while we were idle are busy still, most likely)."""
        if self._release is not None:
            self._release.set()
            self._release = None
        self._calm = 0


def release_team() -> bool:
    """Free the calling thread's OpenMP team (libgomp's ``omp_pause_resource_all``), so that while this thread
    waits on another one that computes (transformers CB's loop, a bench's worker) its idle team does not count
    against libgomp's spin: with more threads in teams than CPUs, every thread spins briefly (see above).
    Measured at the Qwen2.5-0.5B shape in bf16 on 2 cores: transformers CB took 7.6-8.6 s with the caller's
    team alive and 6.5 s without it. The next parallel region of this thread makes a new team. Returns whether
    a team was freed (False off libgomp, or where the call is missing)."""
    if not _libgomp_loaded():
        return False
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(2) == 0  # omp_pause_hard (omp.h)
