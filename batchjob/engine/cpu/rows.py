"""A layer's small per-row work in one call each, where torch dispatches several ops (``csrc/rows.cpp``).

At a decode step a CPU spends little on the arithmetic between the GEMMs and much on dispatching it: a
SmolLM2-135M step of 16 rows ran ~2,260 torch ops, ~75 a layer. Two groups of them go to the kernel library:

- :func:`write_kv`: a step's new keys and values into the paged cache, both caches in one call (the attention
  hook's two views, transposes, casts and ``index_copy_`` calls); a plain copy, so the cache holds the same
  bits.
- :func:`fuse_norms`: the RMS norms whose ``forward`` is transformers' ``LlamaRMSNorm.forward`` (the same
  bytecode: Llama, Qwen2/3, Mistral and ~140 other classes), 8 ops each. Their forward calls the kernel
  instead: the same arithmetic in the same dtypes (mean of squares in float, the row rounded to the input's
  dtype, then times the weight), the squares added in the order torch's sum adds them (the width of its
  vectors found by trying, :func:`torch_lanes`), so the output is the module's to the bit. Norms of another
  code (Gemma's ``1 + weight``, and any class transformers changes) keep theirs, and so does every norm
  where no width reproduces torch's sums. Not float64, where the exactness tests run through the plain
  modules. ``BATCHJOB_CPU_ROWS=0`` keeps torch's ops for both.
"""

from __future__ import annotations

import functools
import types

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from batchjob import env
from batchjob.engine.cpu import kernel

DISABLE_ENV = "BATCHJOB_CPU_ROWS"
_NORM_SYMBOLS = {torch.float32: "batchjob_rms_norm_f32", torch.bfloat16: "batchjob_rms_norm_bf16"}
# torch's grain size: a single row at least this wide has its sum split between threads, in another order.
SPLIT_ROW = 32768


def available() -> bool:
    return env.flag(DISABLE_ENV) and kernel.load() is not None


@functools.cache
def torch_lanes() -> int | None:
    """The width of the vectors in which torch's CPU sum adds a row's floats, found by trying: the widths the
    norm's kernel can mirror, each against LlamaRMSNorm itself on probe rows of several widths in float32
    (narrower than a vector, a vector and its tail, past the cascade's first level). 8 on the one CPU
    measured (a Zen 4 with AVX-512, 2026-12-07, torch 2.13); None, where none matches, keeps torch's norms."""
    if kernel.load() is None:
        return None
    gen = torch.Generator().manual_seed(0)
    probes = []
    for width in (12, 100, 576, 1000, 4100):
        norm = LlamaRMSNorm(width, eps=1e-6)
        torch.nn.init.normal_(norm.weight, generator=gen)
        x = torch.randn(3, width, generator=gen) * torch.rand(3, 1, generator=gen) * 10
        with torch.no_grad():
            probes.append((x, norm.weight.detach(), norm(x)))
    for lanes in (8, 16, 4):
        if all(torch.equal(_norm(x, w, 1e-6, lanes), want) for x, w, want in probes):
            return lanes
    return None


def write_kv(
    key: torch.Tensor,  # [1, KVH, T, D], any strides with D contiguous
    value: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], contiguous, key's dtype
    v_cache: torch.Tensor,
) -> None:
    lib = kernel.load()
    assert lib is not None and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    assert key.stride(3) == value.stride(3) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    slots = slots.contiguous()
    _, kv_heads, tokens, dim = key.shape
    lib.batchjob_write_kv(
        key.data_ptr(),
        key.stride(1),
        key.stride(2),
        value.data_ptr(),
        value.stride(1),
        value.stride(2),
        slots.data_ptr(),
        tokens,
        kv_heads,
        dim,
        key.element_size(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's product for ``x`` [..., n] and ``weight`` [n] of one dtype (float32 or bfloat16), to
    the bit (check :func:`torch_lanes` first)."""
    lanes = torch_lanes()
    assert lanes is not None, "torch sums rows in an order the norm's kernel does not mirror"
    return _norm(x, weight, eps, lanes)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
    lib = kernel.load()
    assert lib is not None and x.dtype == weight.dtype and weight.is_contiguous()
    n = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    symbol = getattr(lib, _NORM_SYMBOLS[x.dtype])
    symbol(x.data_ptr(), x.numel() // n, n, n, weight.data_ptr(), eps, lanes, out.data_ptr())
    return out


def _code(fn) -> tuple:
    code = fn.__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


def _norm_forward(self: LlamaRMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:  # a float32 norm in a bf16 model: transformers' own
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def fuse_norms(model: torch.nn.Module) -> int:
    """Give each of the model's Llama-layout RMS norms (float32 or bf16) the kernel's forward; returns how many."""
    if not available() or torch_lanes() is None:
        return 0
    llama = _code(LlamaRMSNorm.forward)
    count = 0
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        weight = getattr(module, "weight", None)
        if (
            forward is None
            or "forward" in vars(module)  # already given another forward (fused before, or by someone else)
            or not hasattr(forward, "__code__")
            or _code(forward) != llama
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 1
            or not weight.is_contiguous()
            or weight.dtype not in _NORM_SYMBOLS
            or weight.device.type != "cpu"
            or not isinstance(getattr(module, "variance_epsilon", None), float)
            or weight.numel() >= SPLIT_ROW  # torch may split such a row's sum between threads
        ):
            continue
        module.forward = types.MethodType(_norm_forward, module)
        count += 1
    return count
