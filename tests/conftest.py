from __future__ import annotations

import pytest
import torch

from tests import jobproc
from tests.tiers import TierGuard, engine_fixture, process_fixture, tier_of
from tests.tiny_models import make_decisive_model, make_model

# Tiers (tests/tiers.py): `unit` (pure Python and tensors, no model, no process: the inner loop), `engine`
# (tiny models in this process), `process` (real `batchjob` processes: kills, signals, shards, Slurm). A test's
# tier comes from the fixtures it uses and its markers, never from its module or its source text.
_TIER = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.stash[_TIER] = tier = tier_of(item)
        item.add_marker(getattr(pytest.mark, tier))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _guarded(item):
    """The guard of a unit or engine test's tier, for its setup (its module's fixtures included) and call."""
    tier = item.stash.get(_TIER, None)
    return TierGuard(item.nodeid, tier) if tier in ("unit", "engine") else None


def _under_guard(item):
    """A hook wrapper's body: the phase (yielded to) runs under the test's tier guard."""
    guard = _guarded(item)
    if guard is None:
        return (yield)
    with guard:
        result = yield
    _fail_on(guard)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _under_guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _under_guard(item))


def _fail_on(guard):
    """Fail a test whose forbidden attempt was caught and swallowed by the code under test."""
    if guard.violations:
        pytest.fail(guard.violations[0], pytrace=False)


@engine_fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Folders of tiny random llama, qwen2 and gpt2 models (with a tokenizer), built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {f: make_model(root / f, f) for f in ("llama", "qwen2", "gpt2")}


@engine_fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    """The tiny llama folder: the model most tests use."""
    return tiny_model_dirs["llama"]


@engine_fixture(scope="session")
def decisive_model_dir(tmp_path_factory):
    """A tiny llama with a sharpened head (:func:`tests.tiny_models.make_decisive_model`): for the tests that
    need decisive picks, such as sampled text repetitive enough for drafts to be taken."""
    return make_decisive_model(tmp_path_factory.mktemp("decisive") / "llama", "llama")


@pytest.fixture
def drafts_pay(monkeypatch):
    """Every proposed draft pays: for the tests that must see drafts verified. Whether a draft pays is
    decided by the steps' measured times, so on a loaded machine a test could otherwise see none."""
    from batchjob.engine.speculative import StepCost

    monkeypatch.setattr(StepCost, "threshold", lambda self, outputs, prompt_rows, sampled_rows: 0.0)


@engine_fixture(params=["kernel", "reference"])
def decode_path(request, monkeypatch):
    """Run a test with CPU decode attention by the compiled kernel, then by the torch reference."""
    from batchjob.engine.cpu import kernel as cpu_kernel

    if request.param == "kernel" and cpu_kernel._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    if request.param == "reference":
        monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    cpu_kernel.load.cache_clear()
    yield request.param
    cpu_kernel.load.cache_clear()


@process_fixture
def launch():
    """Start ``python -m batchjob run ARGS`` as a real process (:func:`tests.jobproc.launch`, same arguments);
    any still running when the test ends is killed, so no test leaves a job behind."""
    started = []

    def start(args, **env):
        started.append(jobproc.launch(args, **env))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
