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
