"""The ``flash_attn`` backend: flash-attn's paged varlen kernel (CUDA, bf16/fp16, pages of a multiple of 256
tokens), when the package is installed; the CUDA default then.

Its metadata is cumulative query and key lengths and an int32 block table; the kernel reads K/V straight
from the paged cache through the table, and aligns its causal mask bottom-right when a request has fewer
queries than keys, as ours is. A window of W keys is (W - 1, 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.attention.base import HALF_DTYPES, AttentionBackend
from batchjob.engine.attention.layout import Packer, StepLayout

PAGED_FLASH_BLOCK = 256  # FlashAttention-2's paged kernels take pages of a multiple of this


@functools.cache
def installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class FlashMeta:
    cu_q: torch.Tensor  # [R + 1] int32 first query row of each request
    cu_k: torch.Tensor  # [R + 1] int32 cumulative key counts
    block_table: torch.Tensor  # [R, max_blocks] int32
    max_q: int
    max_k: int


class FlashAttn(AttentionBackend):
    name = "flash_attn"
    option = "flash"
    devices = ("cuda",)
    dtypes = HALF_DTYPES
    page_multiple = PAGED_FLASH_BLOCK
    default_block_size = PAGED_FLASH_BLOCK

    @classmethod
    def missing(cls, device, dtype) -> str | None:
        return None if installed() else "flash-attn is not installed"

    def pack(self, lay: StepLayout, pk: Packer):
        cu_k = np.concatenate([[0], np.cumsum(lay.ends)])
        return pk.add(lay.offsets), pk.add(cu_k), pk.add(lay.table), int(lay.n.max()), int(lay.ends.max())

    def metadata(self, handles, buf: torch.Tensor) -> FlashMeta:
        cu_q, cu_k, table, max_q, max_k = handles
        v = Packer.view
        i32 = torch.int32
        return FlashMeta(v(buf, cu_q).to(i32), v(buf, cu_k).to(i32), v(buf, table).to(i32), max_q, max_k)

    def decode_metadata(self, slots, table, lens) -> FlashMeta:
        rows = table.shape[0]
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        cu_k = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        return FlashMeta(cu_q, cu_k, table.to(torch.int32), 1, table.shape[1] * self.block_size)

    def forward(
        self,
        data: FlashMeta,
        q,
        key,
        value,
        k_cache,
        v_cache,
        scale,
        window,
        softcap=None,
        slopes=None,
        sinks=None,
    ):
        from flash_attn import flash_attn_varlen_func  # optional: only when the backend was chosen

        return flash_attn_varlen_func(
            q.transpose(0, 1),
            k_cache,
            v_cache,
            data.cu_q,
            data.cu_k,
            data.max_q,
            data.max_k,
            softmax_scale=scale,
            causal=True,
            window_size=(window - 1, 0) if window is not None else (-1, -1),
            block_table=data.block_table,
        )
