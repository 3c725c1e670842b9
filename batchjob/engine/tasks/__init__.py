"""The prefill-only tasks (embed, classify, score) beside the generating core: their engine (engine.py, a
``TaskEngine`` that :func:`engine_class` picks from the option ``task``), its chunk policies (policy.py),
the heads and pooling that make results from hidden states (runner.py), what a sentence-transformers
folder says about them and about each text's input (st_folder.py), and each request's state
(state.py, a leaf: the request and the job layer import it without torch).

This module imports nothing of the engine, so ``batchjob.engine.tasks.state`` stays light and the core can
name its factory: the task engine subclasses the core's ``Engine``, so the core names it here by module
and class (as vLLM's model registry names its model classes), imported when such an engine is built.
"""

from __future__ import annotations

import importlib
from typing import Any

PREFILL_TASKS = ("embed", "classify", "score")
_TASK_ENGINE = ("batchjob.engine.tasks.engine", "TaskEngine")  # the engine class of every prefill task


def engine_class(task: str) -> Any:
    """The engine class that runs ``task`` when it is not the core's (generation); None for generation."""
    if task not in PREFILL_TASKS:
        return None
    module, name = _TASK_ENGINE
    return getattr(importlib.import_module(module), name)
