"""KV storage: per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def allocate_kv_cache(
    shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeros, not empty: attention reads padded and not-yet-written slots under a mask, and a NaN left in
    # uninitialised memory would survive a zero attention weight.
    dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return [
        (torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device))
        for _ in range(shape.num_layers)
    ]
