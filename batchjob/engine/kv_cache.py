"""KV storage: per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVShape:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def _madvise_huge_pages(address: int, length: int) -> None:
    """Ask Linux for transparent huge pages on this range (a no-op elsewhere, or if it says no)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE))
    except (OSError, AttributeError):
        pass


def _cpu_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU memory on 2 MiB pages where the OS offers them: decode attention reads blocks scattered
    over the whole pool, and huge pages spare it most TLB misses. Pages are advised before the zeroing
    touches them, so they are faulted in huge from the start."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE_PAGE
    buf = raw[start : start + nbytes]
    _madvise_huge_pages(buf.data_ptr(), nbytes // _HUGE_PAGE * _HUGE_PAGE)
    return buf.zero_().view(dtype)


def allocate_kv_cache(
    shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeros, not empty: attention reads padded and not-yet-written slots under a mask, and a NaN left in
    # uninitialised memory would survive a zero attention weight.
    dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    if device.type != "cpu":
        return [
            (torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device))
            for _ in range(shape.num_layers)
        ]
    per_tensor = num_blocks * block_size * shape.num_kv_heads * shape.head_dim
    pool = _cpu_zeros(2 * shape.num_layers * per_tensor, dtype).view(2 * shape.num_layers, *dims)
    return [(pool[2 * i], pool[2 * i + 1]) for i in range(shape.num_layers)]
