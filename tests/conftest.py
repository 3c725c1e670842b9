from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_model


def pytest_collection_modifyitems(config, items):
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
    from batchjob.engine import cpu_kernel

    if request.param == "kernel" and cpu_kernel._compiler() is None:
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    if request.param == "reference":
        monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    cpu_kernel.load.cache_clear()
    yield request.param
    cpu_kernel.load.cache_clear()
