"""The attention backends and the one place that chooses among them.

The registry lists every backend class in the order ``auto`` tries them; the same declarations decide
which model features some backend computes (what is not is refused at load, by
:func:`batchjob.engine.support.check_supported`) and which backend and block size a model gets
(:func:`choose_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.engine.attention.base import AttentionBackend
from batchjob.engine.attention.flash import FlashAttn
from batchjob.engine.attention.flex import Flex
from batchjob.engine.attention.reference import TorchReference
from batchjob.engine.attention.varlen import Varlen
from batchjob.engine.cpu.attention import CpuKernel
from batchjob.errors import ConfigError

# Every backend; ``auto`` takes the first of its device's order that can run the model.
REGISTRY: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (FlashAttn, Varlen, CpuKernel, Flex, TorchReference)
}
AUTO_ORDER = {"cuda": ("flash_attn", "flex", "torch"), "cpu": ("cpu_kernel", "flex", "torch")}
OPTION_CHOICES = ("auto", *(cls.option for cls in REGISTRY.values()))  # the attention_backend option's


def supported_features() -> frozenset[str]:
    """The model features some backend computes exactly."""
    return frozenset().union(*(cls.features() for cls in REGISTRY.values()))


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend called ``name``: its option value (``cpu``, ``flash``) or its own name."""
    for cls in REGISTRY.values():
        if name in (cls.option, cls.name):
            return cls
    raise ConfigError(f"attention backend must be one of {', '.join(OPTION_CHOICES)}; got {name!r}")


@dataclass(frozen=True)
class AttentionChoice:
    backend: str  # a key of REGISTRY
    block_size: int  # tokens per KV block

    @property
    def backend_class(self) -> type[AttentionBackend]:
        return REGISTRY[self.backend]


def choose_attention(
    device: torch.device,
    dtype: torch.dtype,
    features: frozenset[str] = frozenset(),
    block_size: int | None = None,
    backend: str | None = None,
) -> AttentionChoice:
    """The backend for a model needing ``features`` on ``device`` in ``dtype``, and with it the block size.

    ``backend`` (the engine option ``attention_backend``): None or "auto": the first of the device's
    :data:`AUTO_ORDER` that can run the model (on CUDA flash-attn if installed, else flex; on the CPU the
    decode kernel, else flex for soft-capping or sinks, else the torch reference); else that backend, which
    must be able to. ``block_size`` None: the backend's default (256 for the flash-attn kernels, else 16).
    Raises ``ConfigError`` for a feature no backend implements, or a forced backend that cannot run here.
    """
    unknown = features - supported_features()
    if unknown:
        raise ConfigError(
            f"the model needs attention features no backend implements exactly: {', '.join(sorted(unknown))}"
        )
    if backend not in (None, "auto"):
        cls = backend_class(backend)
        why = cls.unusable(device, dtype, features, block_size)
        if why is not None:
            raise ConfigError(f"attention backend {cls.name} cannot run here: {why}")
        order: tuple[str, ...] = (cls.name,)
    else:
        order = AUTO_ORDER.get(device.type, ("flex", "torch"))
    for name in order:
        cls = REGISTRY[name]
        if cls.unusable(device, dtype, features, block_size) is None:
            return AttentionChoice(name, block_size or cls.default_block_size)
    raise AssertionError(f"no attention backend for {device} {dtype} {sorted(features)}")  # flex runs all
