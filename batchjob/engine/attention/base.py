"""The attention backend interface: what a backend computes, where it runs, and its two jobs per step.

A backend is a class. Its class attributes declare what it computes exactly (``computes``: the model
features of :mod:`batchjob.engine.support` it applies, beyond plain causal attention; ``bidirectional``
for attention within a row both ways), its block-size rule (``page_multiple``,
``default_block_size``) and the devices and dtypes it takes; ``bidirectional`` backends attend within each
row both ways when the runner sets ``causal = False`` on the instance (an encoder: each row is then a whole
request, computed in one step, so its keys are the step's own); :meth:`AttentionBackend.unusable` says why
it cannot run a model somewhere. The registry (:mod:`.registry`) chooses by these declarations alone.

An instance serves one model runner (one KV pool). Each step it builds its own metadata from the runner's
backend-neutral :class:`~batchjob.engine.attention.layout.StepLayout` (:meth:`~AttentionBackend.pack`,
then :meth:`~AttentionBackend.metadata` once the step's single host-to-device copy is done), or for a
graph bucket from the bucket's device buffers (:meth:`~AttentionBackend.decode_metadata`), and then runs
its own :meth:`~AttentionBackend.forward` in every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from batchjob.engine.attention.layout import Packer, StepLayout

ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class AttentionBackend:
    """One way of computing paged attention (see the module's docstring)."""

    name: ClassVar[str]  # as logs, errors and tests name it: "torch", "cpu_kernel", "flex", ...
    option: ClassVar[str]  # its value of the engine option attention_backend (--attention-backend)
    computes: ClassVar[frozenset[str]] = frozenset({"sliding_window"})  # model features it applies exactly
    implemented: ClassVar[frozenset[str]] = frozenset()  # applied when handed, but not claimed (see flex)
    bidirectional: ClassVar[bool] = False  # can attend within a row both ways (encoders)
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ALL_DTYPES
    page_multiple: ClassVar[int] = 1  # block sizes it takes: multiples of this
    default_block_size: ClassVar[int] = 16  # the block size the engine picks with it

    @classmethod
    def features(cls) -> frozenset[str]:
        """The model features it computes, ``bidirectional`` included when it has it."""
        return cls.computes | ({"bidirectional"} if cls.bidirectional else set())

    @classmethod
    def applies(cls) -> frozenset[str]:
        """What its forward applies when a layer hands it over: what it computes, and more."""
        return cls.features() | cls.implemented

    @classmethod
    def missing(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """What this machine lacks for it (a package, a compiler), in words; None when nothing."""
        return None

    @classmethod
    def unusable(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        features: frozenset[str] = frozenset(),
        block_size: int | None = None,
    ) -> str | None:
        """Why it cannot run a model needing ``features`` here; None when it can."""
        lacking = features - cls.features()
        if lacking:
            return f"it does not implement {', '.join(sorted(lacking))}"
        if device.type not in cls.devices:
            return f"it needs a {' or '.join(d.upper() for d in cls.devices)} device"
        if dtype not in cls.dtypes:
            return f"it takes {' or '.join(_dtype_name(d) for d in cls.dtypes)}, not {_dtype_name(dtype)}"
        if block_size is not None and block_size % cls.page_multiple:
            return (
                f"its paged kernel needs blocks of a multiple of {cls.page_multiple} tokens, not {block_size}"
            )
        return cls.missing(device, dtype)

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: K, V [blocks, block_size, KVH, D]
        block_size: int,
        device: torch.device,
        num_heads: int,  # query heads
        max_rows: int,  # rows one step can have
    ) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_heads = num_heads
        self.max_rows = max_rows
        self.causal = True  # False (set by the runner, only where ``bidirectional``): rows attend both ways
        # False (``ModelRunner.rows_alike``, a hook): no separate path for one-token rows, whose
        # batched calls pad to their group's longest row; each row is then attended the same way whatever
        # shares its step.
        self.decode_rows = True

    @property
    def reads_cache(self) -> bool:
        """Whether :meth:`forward` reads the step's new keys and values from the paged cache; False: it takes
        them from the step's own ``key``/``value``, and the hook does not write them there."""
        return True

    def write_kv(self, key, value, slots, k_cache, v_cache) -> None:
        """Write the step's new keys and values ([1, KVH, T, D]) into the paged cache at ``slots`` ([T])."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, slots, key[0].transpose(0, 1).to(flat_k.dtype))  # [T, KVH, D]
        flat_v.index_copy_(0, slots, value[0].transpose(0, 1).to(flat_v.dtype))

    # -- each step -------------------------------------------------------------------------------------

    def pack(self, lay: StepLayout, pk: Packer) -> Any:
        """Add the step's index arrays to the packer; returns handles for :meth:`metadata`."""
        raise NotImplementedError

    def metadata(self, handles: Any, buf: torch.Tensor) -> Any:
        """The step's metadata from the device buffer the packer sent."""
        raise NotImplementedError

    def decode_metadata(self, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> Any:
        """Metadata of a graph bucket: row i is one query at position ``lens[i] - 1`` attending through
        block table ``table[i]`` (device tensors, so a CUDA graph can capture what is built from them)."""
        raise NotImplementedError

    def forward(
        self,
        data: Any,  # what metadata() or decode_metadata() built
        q: torch.Tensor,  # [H, T, D] the step's queries
        key: torch.Tensor,  # [1, KVH, T, D] the step's new keys (already in the cache)
        value: torch.Tensor,  # [1, KVH, T, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] this layer's
        v_cache: torch.Tensor,
        scale: float | None,  # None: 1 / sqrt(D), as SDPA takes it
        window: int | None,  # keys a query sees, itself included; None: all
        softcap: float | None = None,
        slopes: torch.Tensor | None = None,  # [H] ALiBi slopes
        sinks: torch.Tensor | None = None,  # [H] sink logits
    ) -> torch.Tensor:
        """Attention of every query of the step; returns [T, H, D]."""
        raise NotImplementedError


@dataclass
class AttentionMetadata:
    """What travels to every attention layer of one forward (one private keyword argument)."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor  # [T] int64 on device: flat cache slot of each new token
    backend: AttentionBackend
    data: Any  # the backend's own metadata


def blocks_for(lens: np.ndarray, block_size: int) -> np.ndarray:
    """Blocks holding ``lens`` tokens."""
    return -(-lens // block_size)
