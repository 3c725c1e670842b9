"""LoRA adapters per request: PEFT folders loaded once and held resident, a request's adapter by name.

The request carries an adapter index (``Request.adapter``, 0: the base model); the runner's step layout
carries it per packed row (``StepLayout.adapter_of_row``) and hands it to :class:`~.layers.LoraStep`;
each target layer adds its rows' low-rank updates beside its own forward (layers.py), so one step mixes
base rows and rows of any number of adapters. The adapter also roots a request's prefix-cache digests
(block_manager.py), so a prefix computed under one adapter never serves another. Reading and refusing
PEFT's format is peft_folder.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from batchjob.engine.lora.layers import LoraStep, install
from batchjob.engine.lora.peft_folder import Adapter, LoraWeights, load_adapter
from batchjob.errors import ConfigError

__all__ = [
    "Adapter",
    "Adapters",
    "LoraStep",
    "Paths",
    "attach",
    "attach_to",
    "index_of",
    "per_prompt",
    "refuse",
]

Paths = Mapping[str, "str | Path"]  # adapter name -> PEFT folder or hub id

log = logging.getLogger(__name__)


class Adapters:
    """The engine's resident adapters: index i + 1 is ``adapters[i]`` (0 is the base model)."""

    def __init__(self, adapters: list[Adapter], step: LoraStep) -> None:
        self.adapters = adapters
        self.step = step
        self._index = {a.name: i + 1 for i, a in enumerate(adapters)}

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    @property
    def nbytes(self) -> int:
        """Memory the adapters' weights take on the device."""
        return sum(a.nbytes for a in self.adapters)

    def index(self, name: str | None) -> int:
        """A request's adapter index: 0 for None or "" (the base model)."""
        if not name:
            return 0
        if name not in self._index:
            known = ", ".join(self._index) or "none loaded"
            raise ConfigError(f"unknown LoRA adapter {name!r} (adapters: {known})")
        return self._index[name]

    def name(self, index: int) -> str | None:
        return self.adapters[index - 1].name if index else None


def refuse(config, sharded: bool) -> None:
    """Refuse by name what adapters are not built with: an ``EngineConfig`` (or options) of a
    tensor-parallel engine or a compiled model."""
    for refused, what in ((sharded, "tensor parallelism"), (config.compile, "compile")):
        if refused:
            raise ConfigError(f"LoRA adapters with {what} are not supported")


def attach(
    model: PreTrainedModel,
    paths: Mapping[str, str | Path],
    model_id: str,
    dtype: torch.dtype,
    device: torch.device,
    heads: tuple[str, ...] = (),
) -> Adapters:
    """Load every adapter of ``paths`` (name -> PEFT folder or hub id) and wrap the layers they target;
    ``heads``: the task head modules an adapter's ``modules_to_save`` may replace (peft_folder.py)."""
    adapters = []
    for name, path in paths.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a LoRA adapter needs a name, got {name!r}")
        adapters.append(load_adapter(name, path, model, model_id, dtype, device, heads))
    per_module: dict[str, dict[int, LoraWeights]] = {}
    for i, adapter in enumerate(adapters):
        for module_name, weights in adapter.layers.items():
            per_module.setdefault(module_name, {})[i + 1] = weights
    step = LoraStep(device)
    install(model, step, per_module)
    loaded = Adapters(adapters, step)
    log.info(
        "LoRA: %d adapter(s) resident (%s), %.1f MiB",
        len(adapters),
        ", ".join(f"{a.name} r{a.max_rank}" for a in adapters),
        loaded.nbytes / 2**20,
    )
    return loaded


def attach_to(
    engine: Any, paths: Paths, sharded: bool, *, heads: tuple[str, ...] = (), gathered: bool = False
) -> Adapters:
    """Load ``paths`` into a new engine (its model, runner and config), or refuse what is not built.
    ``heads``: the engine's task head modules (a classifier's); ``gathered``: every step's rows gathered by
    adapter (``LoraStep.gathered``: a row's floats independent of its batch mates)."""
    refuse(engine.config, sharded)
    adapters = attach(engine.model, paths, engine.model_id, engine.dtype, engine.device, heads)
    adapters.step.gathered = gathered
    engine.runner.lora = adapters.step
    if engine.device.type == "cuda":
        engine.runner.graphs = None  # a captured graph would freeze one step's grouping of rows
    return adapters


def index_of(adapters: Adapters | None, name: str | None) -> int:
    """A request's adapter index (0: the base model), for an engine that may hold none."""
    if adapters is None:
        if name:
            raise ConfigError(f"unknown LoRA adapter {name!r} (the engine holds none)")
        return 0
    return adapters.index(name)


def per_prompt(held: Adapters | None, adapters: Sequence[str | None] | None, count: int) -> list[str | None]:
    """One adapter name per prompt of ``Engine.generate`` (None: the base model), each one the engine holds
    (checked before any prompt is added: a refused batch leaves the engine idle)."""
    names: list[str | None] = [None] * count if adapters is None else list(adapters)
    if len(names) != count:
        raise ConfigError(f"got {len(names)} adapters for {count} prompts")
    for name in set(names):
        index_of(held, name)
    return names
