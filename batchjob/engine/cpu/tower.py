"""A vision tower's attention on the CPU's prefill kernels: float32, and bf16 where the CPU has AVX512-BF16.

A vision-language model's tower attends each image's patches both ways, in calls of several images, through
transformers' ``AttentionInterface`` (the language model's attention is batchjob's paged one; the tower keeps
its own). torch's CPU SDPA widens bf16 to float and runs float GEMMs, one (image, head) block at a time; the
kernels of ``csrc/`` take every image of the call at once (:func:`~.kernel.dense_prefill`). Registered
as ``batchjob_cpu_tower`` and given to the tower's config at load (:func:`use_for_tower`); a call the kernel
does not compute exactly as SDPA would (a mask, dropout, a bias, another dtype or head size, keys of another
length) goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchjob.engine.cpu import kernel

TOWER_ATTN = "batchjob_cpu_tower"


def tower_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, KVH, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """[B, T, H, D], as transformers' SDPA function returns it."""
    b, heads, t, dim = query.shape
    if (
        attention_mask is not None
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or query.device.type != "cpu"
        or key.shape[0] != b
        or key.shape[2] != t
        or heads % key.shape[1]
        or not kernel.prefill_takes(query.dtype, dim)
        or key.dtype != query.dtype
        or value.dtype != query.dtype
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    # as transformers' SDPA function decides it: the module's flag unless the call says
    causal = t > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (_flat(x) for x in (query, key, value))  # [H, B * T, D]
    out = torch.empty(b * t, heads, dim, dtype=query.dtype)
    starts = torch.arange(b, dtype=torch.int64) * t
    lens = torch.full((b,), t, dtype=torch.int64)
    scale = dim**-0.5 if scaling is None else scaling
    kernel.dense_prefill(q, k, v, starts, lens, scale, bool(causal), out)
    return out.view(b, t, heads, dim), None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] as [H, B * T, D] without a copy where the batch's rows follow one another in memory (the
    view of one projection's output that attention layers pass), else a copy laid out so."""
    b, h, t, d = x.shape
    if x.stride(3) != 1 or (b > 1 and x.stride(0) != t * x.stride(2)):
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.as_strided((h, b * t, d), (x.stride(1), x.stride(2), 1))


AttentionInterface.register(TOWER_ATTN, tower_attention)


def use_for_tower(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Give a vision-language model's tower :func:`tower_attention` where it may run: float32, and bf16 on a
    CPU with AVX512-BF16 (``BATCHJOB_CPU_PREFILL=0`` keeps SDPA). True when it did."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return False
    set_attn = getattr(model, "set_attn_implementation", None)
    if not kernel.prefill_takes(dtype, 64) or set_attn is None:
        return False
    set_attn({"vision_config": TOWER_ATTN})
    return True
