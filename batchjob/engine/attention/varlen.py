"""The ``varlen`` backend: ``torch.nn.attention.varlen.varlen_attn``, the FlashAttention-2 kernel built into
torch's CUDA wheels (bf16/fp16, sm80+), over the paged cache with flash-attn's metadata and page rule; only
when asked for (``--attention-backend varlen``). A window of W keys is (W - 1, 0): causal, bottom-right."""

from __future__ import annotations

import functools
import inspect

import torch

from batchjob.engine.attention.flash import FlashAttn, FlashMeta


@functools.cache
def import_varlen():
    try:
        from torch.nn.attention import varlen  # only in newer torch versions
    except ImportError:
        return None
    return varlen


class Varlen(FlashAttn):
    name = "varlen"
    option = "varlen"

    @classmethod
    def missing(cls, device, dtype) -> str | None:
        varlen = import_varlen()
        if varlen is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        takes = inspect.signature(varlen.varlen_attn).parameters
        lacks = [name for name in ("block_table", "seqused_k", "enable_gqa") if name not in takes]
        if lacks:  # torch 2.11's varlen_attn reads contiguous keys only: no paged cache
            return f"torch {torch.__version__}'s varlen_attn takes no {', '.join(lacks)} (paged KV cache): needs a newer torch"
        return None

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
        cu_k = data.cu_k
        return import_varlen().varlen_attn(
            q.transpose(0, 1),
            k_cache,
            v_cache,
            data.cu_q,
            cu_k,
            data.max_q,
            data.max_k,
            scale=scale,
            window_size=(window - 1, 0) if window is not None else (-1, 0),
            enable_gqa=k_cache.shape[2] != q.shape[0],
            seqused_k=(cu_k[1:] - cu_k[:-1]).to(torch.int32),
            block_table=data.block_table,
        )
