"""FlexAttention over the paged KV cache, the machinery of the ``flex`` backend (:mod:`.flex`).

A step's requests are attended in at most two calls per layer: the requests with one new token as a batch
of B single queries (decode), and the requests with several (prompt chunks, draft verification) as a batch
of B query chunks padded to one length L. Keys and values are not copied: a layer's whole cache
``[num_blocks, block_size, kv_heads, dim]`` is one sequence of ``num_blocks * block_size`` slots to the
kernel, and a ``BlockMask`` whose key blocks are single pages lists, for each block of a request's queries,
only that request's pages it may see (causal, bottom-right aligned, and within the window). Pages every query
of the block sees whole are listed as full blocks and skip the mask; the pages cut by the diagonal or the
window's edge go through ``mask_mod``, which puts a slot back at its position in the request through
``logical`` (each page's index in its request's block table, written every step: a page shared through the
prefix cache has the same index in every request holding it, since blocks are shared by position).

The query heads that share a KV head are folded into the query axis (query row ``i`` of head ``g`` of a
group becomes row ``i * G + g``), so the kernel runs per KV head and reads each page once for the whole
group, as the CPU decode kernel does and flash-attn does for decoding.

Bidirectional (an encoder's rows, each whole in its step): every query of a request sees what its last
query sees, all of the request's keys; the mask, the BlockMask and the dense path take the last query's
position for every query, so nothing else changes.

``score_mod`` adds what some models need beyond a mask: logit soft-capping (Gemma-2's ``softcap``) and
ALiBi slopes; attention sinks (gpt-oss's ``s_aux``, a learned logit per head that joins the softmax's
denominator and adds no value) are a correction of the output by the log-sum-exp the kernel returns:
``out * sigmoid(lse - sink)``, since ``Z / (Z + e^sink) = 1 / (1 + e^(sink - log Z))``.

Compiled (``torch.compile``): fp32/bf16/fp16 on CUDA (Triton) and on x86 CPUs (inductor's C++ template;
it returns no log-sum-exp, so sinks run dense there). The batch size, chunk length, table width and pool
size are dynamic dimensions and every buffer the mods read has a fixed size, so a model compiles once per
kind of call (decode, chunks) and per window; it does not recompile as steps change shape. The kernel never
runs uncompiled: eager FlexAttention evaluates ``mask_mod`` on every slot and ignores the BlockMask, which
is what keeps a request to its own pages. Batches are padded to at
least two requests and chunks to at least two query blocks, so no dynamic dimension is ever 0 or 1 (torch
specializes those). Where it does not compile (float64, or a compile error), the same mask and score code
runs dense: scores of each request's gathered keys, written out with broadcasting (what FlexAttention's
own eager path computes, without its per-element ``vmap``).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

log = logging.getLogger(__name__)

COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Q_BLOCK = {"cpu": 16, "cuda": 128}  # folded query rows per BlockMask block (a decode call: mostly one)
DECODE, CHUNKS = 0, 1  # the two kinds of call; each has its own fixed-size buffers


@dataclass
class FlexSeqs:
    """The requests of one call: B query chunks of at most ``q_len`` tokens (the rest is padding)."""

    rows: torch.Tensor  # [B * q_len] int64 packed row of query (b, i); -1 for padding
    table: torch.Tensor  # [B, W] int64 KV pages of each request; -1 (or any page, masked) past its context
    start: torch.Tensor  # [B] int64 position of each request's first query
    qlen: torch.Tensor  # [B] int64 queries of each request; 0 for a padding request
    q_len: int
    kind: int = DECODE
    _masks: dict = field(default_factory=dict)  # window -> block-mask tensors, built by the first layer


@dataclass
class FlexMeta:
    state: FlexState
    sets: list[FlexSeqs]


def plan_calls(
    n: np.ndarray,  # [R] tokens each request computes in this step
    starts: np.ndarray,  # [R] tokens it had computed before
    offsets: np.ndarray,  # [R + 1] its first row in the packed sequence
    table: np.ndarray,  # [R, >= max blocks] its block table (padding arbitrary)
    block_size: int,
    min_chunk: int,  # the shortest padded chunk length (at least two query blocks once folded)
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]]:
    """A step's calls, host side: one-token requests together (decode), then requests with several tokens
    (prompt chunks, drafts) padded to one length. Each call: rows [B, L] (-1: padding), table [B, W] (-1
    past a request's context), start [B], qlen [B], L, and its kind."""
    out = []
    ends = starts + n
    for kind, sel in ((DECODE, np.flatnonzero(n == 1)), (CHUNKS, np.flatnonzero(n > 1))):
        if sel.size == 0:
            continue
        length = 1 if kind == DECODE else max(int(n[sel].max()), min_chunk)
        nblk = -(-ends[sel] // block_size)
        width = int(nblk.max())
        tab = table[sel, :width].astype(np.int64)
        tab[np.arange(width)[None, :] >= nblk[:, None]] = -1
        rows = np.full((sel.size, length), -1, dtype=np.int64)
        counts = n[sel]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        rows[np.repeat(np.arange(sel.size), counts), within] = np.repeat(offsets[sel], counts) + within
        out.append((rows, tab, starts[sel].astype(np.int64), counts.astype(np.int64), length, kind))
    return out


def visible(qpos, kpos, qvalid, window: int | None):
    """The mask: key position ``kpos`` is seen by the query at ``qpos`` (bottom-right causal, window)."""
    ok = (kpos <= qpos) & qvalid
    if window is not None:
        ok = ok & (kpos > qpos - window)
    return ok


def modify_score(score, head, qpos, kpos, softcap: float | None, slopes: torch.Tensor | None):
    """The score mod: soft-capping (``softcap * tanh(score / softcap)``, on the scaled logit), then an ALiBi
    bias ``slope[head] * (kpos - qpos)`` (relative to the query: softmax ignores a per-row shift)."""
    if softcap is not None:
        score = softcap * torch.tanh(score / softcap)
    if slopes is not None:
        score = score + slopes[head] * (kpos - qpos).to(score.dtype)
    return score


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [B, KVH, L * G, D], lse [B, KVH, L * G] (natural log; -inf for a row that sees nothing), sinks
    [KVH * G]: the output with each head's sink logit in the softmax's denominator."""
    b, kvh, rows = lse.shape
    g = sinks.shape[0] // kvh
    work = torch.promote_types(lse.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(work).view(b, kvh, rows // g, g) - sinks.to(work).view(1, kvh, 1, g))
    return out * keep.view(b, kvh, rows, 1).to(out.dtype)


def block_tensors(
    seqs: FlexSeqs,
    group: int,
    q_block: int,
    block_size: int,
    window: int | None,
    width: int,
    causal: bool = True,
):
    """The BlockMask of one call, as tensors (built on the device, so a CUDA graph can capture it):
    kv_num [B, 1, nqb] and kv_idx [B, 1, nqb, width] list the pages each block of ``q_block`` folded query
    rows sees in part; full_num and full_idx the pages all its queries see whole."""
    table, start, qlen = seqs.table, seqs.start, seqs.qlen
    b, w = table.shape
    bs = block_size
    nqb = -(-seqs.q_len * group // q_block)
    dev = table.device
    first = (torch.arange(nqb, device=dev) * q_block)[None, :]  # [1, nqb] first folded row of each block
    valid = first < qlen[:, None] * group  # [B, nqb]
    last = torch.minimum(first + q_block, qlen[:, None] * group) - 1
    p_lo = start[:, None] + torch.div(first, group, rounding_mode="floor")  # first and last query position
    p_hi = start[:, None] + torch.div(last, group, rounding_mode="floor")
    if not causal:  # every query sees what the request's last one sees
        p_lo = p_hi = (start + qlen - 1)[:, None].expand_as(p_lo)
    hi = torch.div(p_hi, bs, rounding_mode="floor")  # the last page any query of the block sees
    # full pages: every key at or before the first query, and (window) within the last query's reach
    f_hi = torch.minimum(torch.div(p_lo + 1, bs, rounding_mode="floor") - 1, hi)
    if window is None:
        lo = torch.zeros_like(hi)
        f_lo = lo
    else:
        lo = torch.div((p_lo - window + 1).clamp(min=0), bs, rounding_mode="floor")
        f_lo = torch.maximum(-torch.div(-(p_hi - window + 1).clamp(min=0), bs, rounding_mode="floor"), lo)
    n_full = (f_hi - f_lo + 1).clamp(min=0) * valid
    has_full = n_full > 0
    f_lo = torch.where(has_full, f_lo, hi + 1)
    f_hi = torch.where(has_full, f_hi, hi)
    n1 = f_lo - lo  # partial pages before the full ones, then after them
    n_part = (n1 + hi - f_hi) * valid
    i = torch.arange(w, device=dev)[None, None, :]
    part = torch.where(i < n1[..., None], lo[..., None] + i, f_hi[..., None] + 1 + i - n1[..., None])
    full = f_lo[..., None] + i

    def pages(logical_idx, count):
        idx = logical_idx.clamp(0, w - 1).reshape(b, -1)
        p = table.gather(1, idx).view(b, nqb, w)
        p = torch.where(i < count[..., None], p, 0).clamp(min=0).to(torch.int32)
        if width > w:  # inductor's CPU template wants one entry per page of the cache
            p = torch.nn.functional.pad(p, (0, width - w))
        return p.unsqueeze(1)

    kv_num = n_part.to(torch.int32).unsqueeze(1)
    full_num = n_full.to(torch.int32).unsqueeze(1)
    return kv_num, pages(part, n_part), full_num, pages(full, n_full)


def _paged_kernel(
    q, k_cache, v_cache, logical, info, kv_num, kv_idx, full_num, full_idx, slopes, sinks,
    scale: float, group: int, window: int | None, softcap: float | None, q_block: int, kernel_options,
    causal: bool = True,
):  # fmt: skip
    """One FlexAttention call over the paged cache (the function ``torch.compile`` compiles).
    q [B, KVH, L * G, D], query heads folded; returns the same shape."""
    if not torch.compiler.is_compiling():
        # Run eagerly, FlexAttention would evaluate mask_mod on every slot of the cache, ignoring the
        # BlockMask that keeps each request to its own pages (the caller then runs the dense path).
        raise RuntimeError("the paged FlexAttention kernel only runs compiled")
    _, kvh, rows, _ = q.shape
    nb, bs, _, d = k_cache.shape
    k = k_cache.view(nb * bs, kvh, d).transpose(0, 1).unsqueeze(0)
    v = v_cache.view(nb * bs, kvh, d).transpose(0, 1).unsqueeze(0)
    start, qlen = info[0], info[1]

    def kv_pos(kv_idx):
        return logical[kv_idx // bs] * bs + kv_idx % bs

    def mask_mod(b, h, r, kv_idx):
        i = r // group
        qpos = start[b] + i if causal else start[b] + qlen[b] - 1
        return visible(qpos, kv_pos(kv_idx), i < qlen[b], window)

    def score_mod(score, b, h, r, kv_idx):
        return modify_score(
            score, h * group + r % group, start[b] + r // group, kv_pos(kv_idx), softcap, slopes
        )

    mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(q_block, bs),
        mask_mod=mask_mod,
        seq_lengths=(rows, nb * bs),
        compute_q_blocks=False,
    )
    mods = score_mod if softcap is not None or slopes is not None else None
    if sinks is None:
        return flex_attention(q, k, v, mods, mask, scale=scale, kernel_options=kernel_options)
    out, aux = flex_attention(
        q, k, v, mods, mask, scale=scale, kernel_options=kernel_options, return_aux=AuxRequest(lse=True)
    )
    return apply_sinks(out, aux.lse, sinks)


def dense(
    q, k_cache, v_cache, seqs: FlexSeqs, scale, window, softcap, slopes, sinks, causal: bool = True
) -> torch.Tensor:
    """The same attention written out: each request's pages gathered, every score materialized, the same
    ``visible`` and ``modify_score`` applied with broadcasting. q [B, KVH, L * G, D] -> the same shape."""
    b, kvh, rows, dim = q.shape
    _, bs, _, _ = k_cache.shape
    group = rows // seqs.q_len
    s = seqs.table.shape[1] * bs
    pages = seqs.table.clamp(min=0).reshape(-1)
    k = k_cache.index_select(0, pages).view(b, s, kvh, dim).transpose(1, 2)  # [B, KVH, S, D]
    v = v_cache.index_select(0, pages).view(b, s, kvh, dim).transpose(1, 2)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale  # [B, KVH, R, S]
    dev = q.device
    kv_head = torch.arange(kvh, device=dev)[None, :, None, None]
    r = torch.arange(rows, device=dev)[None, None, :, None]
    kpos = torch.arange(s, device=dev)[None, None, None, :]
    i = torch.div(r, group, rounding_mode="floor")
    qpos = seqs.start[:, None, None, None] + i
    scores = modify_score(scores, kv_head * group + r % group, qpos, kpos, softcap, slopes)
    if not causal:
        qpos = (seqs.start + seqs.qlen - 1)[:, None, None, None]
    ok = visible(qpos, kpos, i < seqs.qlen[:, None, None, None], window)
    scores = scores.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees nothing
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = probs @ v.to(work)
    if sinks is not None:
        out = apply_sinks(out, lse, sinks)
    return out.to(q.dtype)


def _compile(fn):
    """``fn`` under torch.compile, whole graph, static shapes, up to 64 recompiles (one per shape of call):
    torch.compile takes the limit itself in newer torch (2.13, not 2.11); else dynamo's global setting is raised."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, fullgraph=True, dynamic=False, recompile_limit=64)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, fullgraph=True, dynamic=False)


class FlexState:
    """A runner's FlexAttention state: the page -> index map, the fixed-size buffers the compiled mods read,
    and whether the compiled kernel is in use (it is given up, with one warning, if it fails to compile)."""

    def __init__(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, max_rows: int
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.num_blocks = num_blocks
        self.q_block = Q_BLOCK.get(device.type, 128)
        self.compiled = dtype in COMPILED_DTYPES and device.type in ("cpu", "cuda")
        # Every page's index in the block table of the request that holds it; the last entry takes the
        # tables' padding. Stale entries (pages no request of the step holds) are never listed in a mask.
        self.logical = torch.zeros(num_blocks + 1, dtype=torch.int64, device=device)
        # start and qlen of each request of a call, in buffers of a fixed size (inductor's CPU template
        # miscompiles mods that read buffers of a dynamic size).
        self.cap = max(2, max_rows) + 2
        self.info = [torch.zeros(2, self.cap, dtype=torch.int64, device=device) for _ in (DECODE, CHUNKS)]
        # Triton's key tiles must not cross a page; the CPU template takes any page size.
        self.kernel_options = None
        if device.type != "cpu" and block_size % 64:
            self.kernel_options = {"BLOCK_N": math.gcd(block_size, 64)}
        # fullgraph: a compile that fails (or runs out of recompiles) raises, and never falls back to eager.
        self._kernel = _compile(_paged_kernel)

    def begin(self, sets: list[FlexSeqs]) -> FlexMeta:
        """Once per step, before the first layer: pad the calls (see :func:`pad_batch`), record where each
        page of the step sits and the calls' starts and lengths, in the buffers the compiled mods read."""
        sets = [pad_batch(seqs) for seqs in sets]
        for seqs in sets:
            b, w = seqs.table.shape
            assert b <= self.cap, f"{b} requests in one attention call, buffers hold {self.cap}"
            pages = torch.where(seqs.table >= 0, seqs.table, self.num_blocks).reshape(-1)
            index = torch.arange(w, device=self.device).expand(b, w).reshape(-1)
            self.logical.index_put_((pages,), index)
            info = self.info[seqs.kind]
            info[0, :b].copy_(seqs.start)
            info[1, :b].copy_(seqs.qlen)
        return FlexMeta(self, sets)

    def use_kernel(self, sinks) -> bool:
        # inductor's CPU template returns no log-sum-exp, which sinks need.
        return self.compiled and not (sinks is not None and self.device.type == "cpu")

    def attend(self, q, k_cache, v_cache, seqs: FlexSeqs, scale, window, softcap, slopes, sinks, causal=True):
        """q [B, KVH, L * G, D] -> the same shape."""
        if self.use_kernel(sinks):
            try:
                return self._compiled(
                    q, k_cache, v_cache, seqs, scale, window, softcap, slopes, sinks, causal
                )
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - compiler errors come in many types
                log.warning(
                    "FlexAttention did not compile (%s: %s); attention runs dense from now on",
                    type(e).__name__,
                    str(e)[:500],
                )
                self.compiled = False
        return dense(q, k_cache, v_cache, seqs, scale, window, softcap, slopes, sinks, causal)

    def _compiled(self, q, k_cache, v_cache, seqs, scale, window, softcap, slopes, sinks, causal=True):
        group = q.shape[2] // seqs.q_len
        masks = seqs._masks.get(window)
        if masks is None:
            width = self.num_blocks if self.device.type == "cpu" else seqs.table.shape[1]
            masks = block_tensors(seqs, group, self.q_block, self.block_size, window, width, causal)
            seqs._masks[window] = masks
        kv_num, kv_idx, full_num, full_idx = masks
        chunks = seqs.kind == CHUNKS
        # What varies between steps is dynamic, so one compiled kernel serves every step of its kind.
        torch._dynamo.mark_dynamic(q, 0)
        for t in masks:
            torch._dynamo.mark_dynamic(t, 0)
            if chunks:
                torch._dynamo.mark_dynamic(t, 2)
        if chunks:
            torch._dynamo.mark_dynamic(q, 2)
        torch._dynamo.mark_dynamic(kv_idx, 3)
        torch._dynamo.mark_dynamic(full_idx, 3)
        for t in (k_cache, v_cache, self.logical):  # one kernel for every pool size (one engine, or many)
            torch._dynamo.mark_dynamic(t, 0)
        return self._kernel(
            q,
            k_cache,
            v_cache,
            self.logical,
            self.info[seqs.kind],
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            slopes,
            sinks,
            float(scale),
            group,
            window,
            softcap,
            self.q_block,
            self.kernel_options,
            causal,
        )


def pad_batch(seqs: FlexSeqs) -> FlexSeqs:
    """At least two requests, each with a table at least two pages wide: torch specializes a dynamic
    dimension that is 0 or 1, which would compile the kernel again."""
    b, w = seqs.table.shape
    if b >= 2 and w >= 2:
        return seqs
    table = torch.nn.functional.pad(seqs.table, (0, max(0, 2 - w), 0, max(0, 2 - b)), value=-1)
    rows, start, qlen = seqs.rows, seqs.start, seqs.qlen
    if b < 2:
        start = torch.nn.functional.pad(start, (0, 2 - b))
        qlen = torch.nn.functional.pad(qlen, (0, 2 - b))
        rows = torch.nn.functional.pad(rows, (0, (2 - b) * seqs.q_len), value=-1)
    return FlexSeqs(rows, table, start, qlen, seqs.q_len, seqs.kind)


def paged_flex_attention(
    q: torch.Tensor,  # [H, T, D] the step's queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: FlexMeta,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    slopes: torch.Tensor | None = None,  # [H] ALiBi slopes
    sinks: torch.Tensor | None = None,  # [H] sink logits
    causal: bool = True,  # False: each request's queries see all its keys (an encoder's whole rows)
) -> torch.Tensor:
    """Every call of the step; returns [T, H, D]."""
    heads, t, dim = q.shape
    kvh = k_cache.shape[2]
    g = heads // kvh
    out = q.new_empty(t + 1, heads, dim)  # the last row takes the padding's outputs
    for seqs in meta.sets:
        b, n = seqs.table.shape[0], seqs.q_len
        rows = torch.where(seqs.rows < 0, t, seqs.rows)
        qb = q.index_select(1, rows.clamp(max=t - 1)).view(kvh, g, b, n, dim)
        qb = qb.permute(2, 0, 3, 1, 4).reshape(b, kvh, n * g, dim)  # row i of head h*g+j -> (h, i*g+j)
        o = meta.state.attend(qb, k_cache, v_cache, seqs, scale, window, softcap, slopes, sinks, causal)
        o = o.view(b, kvh, n, g, dim).permute(0, 2, 1, 3, 4).reshape(b * n, heads, dim)
        out.index_copy_(0, rows, o)
    return out[:t]
