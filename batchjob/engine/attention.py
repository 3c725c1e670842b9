"""Paged attention plugged into unmodified Hugging Face models through ``AttentionInterface``.

The model runs one packed sequence of ``T`` tokens (batch dimension 1) holding chunks of several requests.
Each attention layer calls :func:`paged_attention` with the new tokens' query, key and value. We write the new
K/V into the paged cache, then let each request's queries attend to that request's cached keys, with a
bottom-right causal alignment (the first query of a chunk sees every earlier cached key of its request).

Everything that describes the batch travels in one private keyword argument, ``batchjob_meta``, built once
per step by the model runner and shared by all layers. The registered name has no mask function, so the
model skips building its own mask.

Backends, chosen in one place (:func:`choose_attention`) by device, dtype and the attention features the
model needs (:func:`attention_features`):

- ``flex``: FlexAttention over the paged cache (:mod:`batchjob.engine.flex`), on every device with nothing
  but torch, at any block size; the only one with logit soft-capping and attention sinks. The default on CUDA
  without flash-attn, and wherever a model needs what the others lack.
- ``flash_attn``: flash-attn's paged varlen kernel (CUDA, bf16/fp16, pages of a multiple of 256 tokens),
  when the package is installed: an optional speed-up.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn``, the same FlashAttention-2 kernel built into torch's
  CUDA wheels (bf16/fp16, sm80+), with the same 256-token page rule; only when asked for.
- ``cpu_kernel``: the CPU default. Single-token rows (and draft verification) by the compiled kernel of
  :mod:`batchjob.engine.cpu.kernel`, which reads the paged cache in place; prompt chunks by one SDPA call
  each over their gathered keys.
- ``torch``: the reference: single-token rows in batched SDPA calls over gathered keys padded to the longest
  request of a length group, prompt chunks by one SDPA call each.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from batchjob.engine import flex, support
from batchjob.engine.cpu import kernel as cpu_kernel
from batchjob.errors import ConfigError

ATTN_NAME = "batchjob_paged"
ATTN_NAME_UNCOMPILED = "batchjob_paged_uncompiled"  # the same, kept out of torch.compile's graphs
META_KWARG = "batchjob_meta"


@dataclass
class PrefillChunk:
    """A request computing ``q_len`` tokens at positions ``[ctx_len - q_len, ctx_len)`` of its sequence."""

    q_start: int  # first row of the packed sequence
    q_len: int
    ctx_len: int  # keys it attends to, its new tokens included
    blocks: torch.Tensor | None  # [num_blocks] int64 its KV blocks; None when the chunk is the whole context
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[q_len, ctx_len] bool, bottom-right causal; None means plain causal (no cached keys)."""
        if window is None and self.q_len == self.ctx_len:
            return None
        if window not in self._masks:
            device = self.blocks.device if self.blocks is not None else None
            qpos = torch.arange(self.ctx_len - self.q_len, self.ctx_len, device=device)[:, None]
            kpos = torch.arange(self.ctx_len, device=device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self._masks[window] = mask
        return self._masks[window]


@dataclass
class DecodeGroup:
    """Requests with one query token each and similar context lengths, attended in one batched call.

    Keys are gathered a whole block at a time (contiguous copies) and padded to the group's longest
    request; sorting by length before grouping keeps the padding small.
    """

    rows: torch.Tensor  # [G] int64 packed rows of the requests' query tokens
    block_table: torch.Tensor  # [G, max_blocks] int64 (padding repeats a valid block, masked out)
    ctx_lens: torch.Tensor  # [G] int64
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[G, 1, 1, max_blocks * block_size] bool: key j is visible to the query at position ctx_len - 1."""
        if window not in self._masks:
            kpos = torch.arange(self.block_table.shape[1] * block_size, device=self.ctx_lens.device)[None, :]
            lens = self.ctx_lens[:, None]
            mask = kpos < lens
            if window is not None:
                mask &= kpos > lens - 1 - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


@dataclass
class AttentionMetadata:
    kv_caches: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: K, V [num_blocks, block_size, kv_heads, dim]
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # flash-attn path (CUDA): cu_seqlens_q, cu_seqlens_k, block_table (int32), max_seqlen_q, max_seqlen_k
    flash: tuple | None = None
    varlen: bool = False  # the flash metadata goes to torch's varlen_attn instead of flash-attn
    decode_kernel: bool = False  # decode groups go to the compiled CPU kernel (one group, any lengths)
    flex: flex.FlexMeta | None = None  # the FlexAttention path: its calls and state


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn's kernels take
BACKEND_ENV = "BATCHJOB_ATTENTION_BACKEND"  # forces a backend (e.g. to compare them in `batchjob bench`)

# The model attention features each backend computes exactly. A model needing one no backend has is refused
# at load, by name.
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "flash_attn": frozenset({"sliding_window"}),
    "varlen": frozenset({"sliding_window"}),
    "flex": flex.FEATURES,
    "cpu_kernel": frozenset({"sliding_window"}),
    "torch": frozenset({"sliding_window"}),
}
SUPPORTED_FEATURES = frozenset().union(*BACKEND_FEATURES.values())  # what some backend handles
BACKENDS = tuple(BACKEND_FEATURES)
PAGED_FLASH_BLOCK = 256  # FlashAttention-2's paged kernels take pages of a multiple of this
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class AttentionChoice:
    backend: str  # one of BACKENDS
    block_size: int  # tokens per KV block


def attention_features(config, model: torch.nn.Module | None = None) -> frozenset[str]:
    """The attention features a model needs beyond plain causal attention (see :mod:`support`):
    ``sliding_window``, ``softcap`` (attention logit soft-capping), ``sinks`` (a learned sink logit per
    head), ``alibi``, and those no backend has (``own_attention``, ``bidirectional``, ...)."""
    return frozenset(name for name, _ in support.model_features(config, model))


@functools.cache
def _import_varlen():
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return varlen


def _unusable(name: str, device: torch.device, dtype: torch.dtype, features, block_size) -> str | None:
    """Why backend ``name`` cannot run this model here; None when it can."""
    missing = features - BACKEND_FEATURES[name]
    if missing:
        return f"it does not implement {', '.join(sorted(missing))}"
    if name in ("flash_attn", "varlen"):
        if device.type != "cuda":
            return "it needs a CUDA device"
        if dtype not in FLASH_DTYPES:
            return f"it takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
        if block_size is not None and block_size % PAGED_FLASH_BLOCK:
            return (
                f"its paged kernel needs blocks of a multiple of {PAGED_FLASH_BLOCK} tokens, not {block_size}"
            )
        if name == "flash_attn" and not flash_attn_available():
            return "flash-attn is not installed"
        if name == "varlen" and _import_varlen() is None:
            return "this torch has no torch.nn.attention.varlen"
    if name == "cpu_kernel" and not cpu_kernel.supports(dtype, device):
        return "it runs float32/float64 on a CPU with a C++ compiler"
    return None


def choose_attention(
    device: torch.device,
    dtype: torch.dtype,
    features: frozenset[str] = frozenset(),
    block_size: int | None = None,
    backend: str | None = None,
) -> AttentionChoice:
    """The one place that picks the attention backend, and with it the default block size.

    ``backend``: one of :data:`BACKENDS`; None or "auto": ``$BATCHJOB_ATTENTION_BACKEND`` if set, else
    the first that can run this model here: on CUDA flash-attn (pages of 256 tokens) if installed, else
    flex; on the CPU the decode kernel, else flex (models needing soft-capping or sinks), else the torch
    reference. ``block_size`` None: 256 for the flash-attn kernels, else 16. Raises ``ConfigError`` for a
    feature no backend implements, or a forced backend that cannot run here.
    """
    unknown = features - SUPPORTED_FEATURES
    if unknown:
        raise ConfigError(
            f"the model needs attention features no backend implements exactly: {', '.join(sorted(unknown))}"
        )
    forced = backend if backend not in (None, "auto") else os.environ.get(BACKEND_ENV, "").strip() or None
    if forced == "auto":
        forced = None
    if forced is not None:
        if forced not in BACKENDS:
            raise ConfigError(
                f"attention backend must be auto or one of {', '.join(BACKENDS)}; got {forced!r}"
            )
        why = _unusable(forced, device, dtype, features, block_size)
        if why is not None:
            raise ConfigError(f"attention backend {forced} cannot run here: {why}")
        order = [forced]
    elif device.type == "cuda":
        order = ["flash_attn", "flex", "torch"]
    else:
        order = ["cpu_kernel", "flex", "torch"]
    for name in order:
        if _unusable(name, device, dtype, features, block_size) is None:
            default = PAGED_FLASH_BLOCK if name in ("flash_attn", "varlen") else DEFAULT_BLOCK_SIZE
            return AttentionChoice(name, block_size or default)
    raise AssertionError(f"no attention backend for {device} {dtype} {sorted(features)}")  # flex runs all


def flash_attn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """flash-attn installed, a CUDA device, and a half-precision KV cache."""
    return device.type == "cuda" and dtype in FLASH_DTYPES and flash_attn_available()


@functools.cache
def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_attention(q, k_cache, v_cache, meta: AttentionMetadata, scaling, sliding_window):
    """flash-attn's varlen kernel reading K/V straight from the paged cache through the block table.

    Its causal mask is aligned bottom-right when a request has fewer queries than keys, as ours is.
    """
    from flash_attn import flash_attn_varlen_func

    cu_q, cu_k, block_table, max_q, max_k = meta.flash
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=scaling,
        causal=True,
        window_size=window,
        block_table=block_table,
    )


def _varlen_attention(q, k_cache, v_cache, meta: AttentionMetadata, scaling, sliding_window):
    """torch's own FlashAttention-2 (``varlen_attn``) over the paged cache: the flash-attn metadata, the
    context lengths as ``seqused_k``. A window of W keys is (W - 1, 0): causal, bottom-right aligned."""
    varlen = _import_varlen()
    cu_q, cu_k, block_table, max_q, max_k = meta.flash
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
    return varlen.varlen_attn(
        q,
        k_cache,
        v_cache,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scaling,
        window_size=window,
        enable_gqa=k_cache.shape[2] != q.shape[1],
        seqused_k=(cu_k[1:] - cu_k[:-1]).to(torch.int32),
        block_table=block_table,
    )


# torch >= 2.5 attends grouped-query heads without repeating the keys.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _sdpa(q, k, v, mask, scale, is_causal=False):
    # q [B, H, Lq, D]; k, v [B, KVH, Lk, D]
    if k.shape[1] != q.shape[1]:
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
            )
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs[META_KWARG]
    softcap, sinks, slopes = kwargs.get("softcap"), kwargs.get("s_aux"), kwargs.get("alibi_slopes")
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    k_new = key[0].transpose(0, 1)  # [T, KVH, D]
    v_new = value[0].transpose(0, 1)
    flat_k.index_copy_(0, meta.slot_mapping, k_new.to(flat_k.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, v_new.to(flat_v.dtype))

    scale = scaling if scaling is not None else head_dim**-0.5
    if meta.flex is not None:
        out = flex.paged_flex_attention(
            query[0], k_cache, v_cache, meta.flex, scale, sliding_window, softcap, slopes, sinks
        )
        return out.unsqueeze(0), None
    # Chosen at load so that this never happens: the other backends would silently ignore these.
    assert softcap is None and sinks is None and slopes is None, (
        "this model needs soft-capping, sinks or ALiBi, which only the flex attention backend computes"
    )
    if meta.flash is not None:
        call = _varlen_attention if meta.varlen else _flash_attention
        out = call(query[0].transpose(0, 1), k_cache, v_cache, meta, scaling, sliding_window)
        return out.unsqueeze(0), None

    q = query[0]  # [H, T, D]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]

    num_heads, block_size = q.shape[0], k_cache.shape[1]
    for group in meta.decode_groups:
        if meta.decode_kernel:
            qd = q.index_select(1, group.rows).transpose(0, 1)  # [G, H, D]
            out[group.rows] = cpu_kernel.paged_decode(
                qd, k_cache, v_cache, group.block_table, group.ctx_lens, scale, sliding_window
            )
            continue
        g = group.rows.shape[0]
        # One query per request: fold each KV head's group of query heads into the query axis, so the
        # cached keys are attended without being repeated for grouped-query attention.
        qd = q.index_select(1, group.rows).transpose(0, 1)  # [G, H, D]
        qd = qd.reshape(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
        blocks = group.block_table.reshape(-1)
        kd = k_cache.index_select(0, blocks).view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, blocks).view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
        mask = group.mask(sliding_window, block_size)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scaling)
        out[group.rows] = od.reshape(g, num_heads, head_dim)

    for chunk in meta.prefills:
        s, e = chunk.q_start, chunk.q_start + chunk.q_len
        qp = q[:, s:e].unsqueeze(0)  # [1, H, q, D]
        if chunk.blocks is None:
            kp, vp = key[:, :, s:e], value[:, :, s:e]
        else:
            kp = k_cache.index_select(0, chunk.blocks).view(-1, num_kv_heads, head_dim)[: chunk.ctx_len]
            vp = v_cache.index_select(0, chunk.blocks).view(-1, num_kv_heads, head_dim)[: chunk.ctx_len]
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        mask = chunk.mask(sliding_window)
        op = _sdpa(qp, kp, vp, mask, scaling, is_causal=mask is None and chunk.q_len > 1)
        out[s:e] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
AttentionInterface.register(ATTN_NAME_UNCOMPILED, torch.compiler.disable(paged_attention))
