from __future__ import annotations

import inspect

import pytest
import torch

from tests.tiny_models import make_model

# Tiers: `unit` (pure Python and tensors, no model: the inner loop, well under a minute), `engine` (tiny
# models in this process), `process` (real `batchjob` processes: kills, signals, shards, Slurm).
PROCESS_MODULES = {
    "test_resume",
    "test_scale",
    "test_signals",
    "test_disk",
    "test_checkpoint_damage",
    "test_cluster",
}
ENGINE_MODULES = {"test_families", "test_gpu", "test_graphs", "test_engine", "test_bench", "test_tasks"}
MODEL_FIXTURES = {"tiny_model_dir", "tiny_model_dirs", "decode_path", "task_model_dirs"}


def _tier(item) -> str:
    module = item.module.__name__.rsplit(".", 1)[-1]
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        source = ""
    if module in PROCESS_MODULES or "launch(" in source or "subprocess." in source:
        return "process"
    if module in ENGINE_MODULES or MODEL_FIXTURES & set(item.fixturenames):
        return "engine"
    return "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Folders of tiny random llama, qwen2 and gpt2 models (with a tokenizer), built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {f: make_model(root / f, f) for f in ("llama", "qwen2", "gpt2")}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    """The tiny llama folder: the model most tests use."""
    return tiny_model_dirs["llama"]


@pytest.fixture(params=["kernel", "reference"])
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
