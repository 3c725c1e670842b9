"""The spin guard: the CPU counters it reads, the helper OpenMP team it holds while other programs are busy,
and its verdict on a real busy machine (two spinning processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from batchjob import Engine, SamplingParams
from batchjob.engine import cpu
from batchjob.engine.cpu import spin as cpu_spin
from batchjob.engine.cpu.spin import SpinGuard, busy_ticks, own_ticks

linux_libgomp = pytest.mark.skipif(
    not cpu_spin._libgomp_loaded(), reason="torch's OpenMP runtime here is not libgomp (or no /proc)"
)

STAT = """cpu  900 10 300 5000 40 0 5 7 0 0
cpu0 500 10 100 2000 20 0 3 5 0 0
cpu1 400 0 200 3000 20 0 2 2 0 0
intr 12345
"""


def test_busy_ticks_count_all_but_idle_and_iowait_of_our_cpus():
    assert busy_ticks(STAT, {0}) == 500 + 10 + 100 + 3 + 5
    assert busy_ticks(STAT, {0, 1}) == 618 + 400 + 200 + 2 + 2
    assert busy_ticks(STAT, {5}) == 0


def test_own_ticks_reads_utime_and_stime_past_a_name_with_spaces():
    fields = ["S"] + [str(i) for i in range(4, 60)]  # field n holds the number n from the 4th on
    text = "4242 (python (my job)) " + " ".join(fields)
    assert own_ticks(text) == 14 + 15


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batchjob-spin-guard"]


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def new_helpers():
    """The spin-guard helpers started during the test. An engine of an earlier test in this process may still
    hold its own (on a loaded machine its guard turned on and it was never released), so count only ours."""
    before = set(_helpers())
    return lambda: [t for t in _helpers() if t not in before]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@linux_libgomp
def test_busy_readings_hold_a_helper_team_and_calm_ones_let_it_go(two_threads, new_helpers):
    guard = SpinGuard(torch.device("cpu"))
    assert guard.enabled and not guard.on and not new_helpers()
    tasks = len(os.listdir("/proc/self/task"))
    guard.observe(1.5)
    assert guard.on and guard.times_on == 1
    # the helper and the OpenMP thread of its own team: libgomp now manages more threads than before
    assert _wait_for(lambda: len(os.listdir("/proc/self/task")) >= tasks + 2)
    guard.observe(1.0)  # still busy: the same helper
    assert guard.times_on == 1 and len(new_helpers()) == 1
    for _ in range(cpu_spin.CALM_CHECKS - 1):
        guard.observe(0.0)
    assert guard.on  # not yet: a few calm readings in a row first
    guard.observe(0.1)
    assert not guard.on
    assert _wait_for(lambda: not new_helpers())
    assert _wait_for(lambda: len(os.listdir("/proc/self/task")) <= tasks)


@linux_libgomp
def test_release_on_idle_is_rearmed_by_the_next_step_within_a_window(two_threads):
    guard = SpinGuard(torch.device("cpu"))
    guard.observe(2.0)
    guard._last = (time.monotonic(), 0, 0)  # a reading just now
    guard.release()
    assert not guard.on
    guard.check()  # no new reading yet: the last verdict (busy) holds
    assert guard.on and guard.times_on == 2
    guard.release()


def test_guard_is_off_on_one_thread_and_for_other_devices(two_threads):
    assert not SpinGuard(torch.device("meta")).enabled
    torch.set_num_threads(1)
    guard = SpinGuard(torch.device("cpu"))
    assert not guard.enabled
    guard.check()  # does nothing
    assert not guard.on and guard._last is None


@pytest.mark.process
@linux_libgomp
@pytest.mark.timeout(60)
def test_two_spinning_processes_turn_the_guard_on(two_threads):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)
        guard = SpinGuard(torch.device("cpu"))  # first reading
        time.sleep(cpu_spin.CHECK_INTERVAL_S + 0.3)
        guard.check()
        assert guard.on, "other programs kept both CPUs busy, the guard should have seen it"
        guard.release()
    finally:
        for p in hogs:
            p.kill()
            p.wait()


@linux_libgomp
def test_engine_checks_each_step_and_releases_when_idle(
    tiny_model_dir, two_threads, new_helpers, monkeypatch
):
    monkeypatch.setenv(cpu.SPIN_GUARD_ENV, "0")
    assert (
        Engine.from_pretrained(str(tiny_model_dir), dtype="float32", device="cpu").platform.spin_guard is None
    )
    monkeypatch.delenv(cpu.SPIN_GUARD_ENV)  # on by default
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float32", device="cpu")
    assert engine.platform.spin_guard is not None and engine.platform.spin_guard.enabled
    engine.platform.spin_guard.observe(3.0)  # as if other programs were busy
    assert engine.platform.spin_guard.on
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert engine.stats.short_spin_steps >= 1
    assert not engine.platform.spin_guard.on  # idle again: the runtime is left as found
    assert _wait_for(lambda: not new_helpers())


_TEAM_CHILD = """
import json, os, time, torch
from batchjob.engine.cpu.spin import release_team
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
def settled(want):
    end = time.monotonic() + 5
    while count() != want and time.monotonic() < end:
        time.sleep(0.01)
    return count()
before = count()
torch.ones(1 << 20).mul_(2)  # a parallel region: this thread's team gets a worker thread
with_team = count()
freed = release_team()
after = settled(with_team - 1)
torch.ones(1 << 20).mul_(2)  # the next region makes a new team
print(json.dumps([before, with_team, freed, after, count()]))
"""


@pytest.mark.process  # a fresh interpreter: the thread count is its own
@linux_libgomp
def test_release_team_frees_the_calling_threads_openmp_workers():
    """The bench calls it before it waits on another thread's work (transformers CB's loop): the caller's idle
    team must go, and the OS threads with it, or libgomp counts more threads than CPUs and spins briefly."""
    out = subprocess.run([sys.executable, "-c", _TEAM_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, with_team, freed, after, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert with_team == before + 1 and freed
    assert after == before and again == with_team
