"""The ``torch`` backend, the reference: plain SDPA over gathered keys, on every device and dtype.

Single-token rows go in batched SDPA calls over their requests' keys, gathered a whole block at a time and
padded to the longest request of a length group; prompt chunks (and draft verification) by one SDPA call
each over their gathered keys, with a bottom-right causal mask. It computes windows, and with ``causal``
off (an encoder) attends within each row both ways: a row is then a whole request, one SDPA call, without a
mask or with a window both ways (ModernBERT's local layers: keys closer than the window on either side).
A chunk's rows may see past themselves (``StepLayout.key_ends``: Gemma 3's image tokens see their whole
image), its mask then bounds each row by its own end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchjob.engine.attention.base import AttentionBackend, blocks_for
from batchjob.engine.attention.layout import Packer, StepLayout


@dataclass
class PrefillChunk:
    """A request computing ``q_len`` tokens at positions ``[ctx_len - q_len, ctx_len)`` of its sequence."""

    q_start: int  # first row of the packed sequence
    q_len: int
    ctx_len: int  # keys it attends to, its new tokens included
    blocks: torch.Tensor | None  # [num_blocks] int64 its KV blocks; None when the chunk is the whole context
    causal: bool = True  # False: the whole row attends both ways (blocks is then None)
    key_ends: torch.Tensor | None = None  # [q_len] int64 past the last key each row sees; None: causal
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device | None = None) -> torch.Tensor | None:
        """[q_len, ctx_len] bool, bottom-right causal (or to each row's ``key_ends``); None means plain
        causal (no cached keys), or with ``causal`` off and no window no mask at all. A window of ``w`` keeps
        the keys less than ``w`` positions before the query (itself included), and with ``causal`` off also
        after it."""
        if not self.causal:
            assert self.blocks is None, "a bidirectional row is whole, computed in one step"
            if window is None:
                return None
        elif window is None and self.q_len == self.ctx_len and self.key_ends is None:
            return None
        if window not in self._masks:
            device = self.blocks.device if self.blocks is not None else device
            qpos = torch.arange(self.ctx_len - self.q_len, self.ctx_len, device=device)[:, None]
            kpos = torch.arange(self.ctx_len, device=device)[None, :]
            if self.causal:
                mask = kpos <= qpos if self.key_ends is None else kpos < self.key_ends[:, None]
                if window is not None:
                    mask &= kpos > qpos - window
            else:  # a window both ways
                mask = (kpos - qpos).abs() < window
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
class SdpaMeta:
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


def decode_groups(rows: np.ndarray, ctx_lens: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Split single-token requests into groups of similar length, so padding to the longest wastes little.

    Sorted by length, a group grows while padding all of it to its longest member costs at most a quarter
    more blocks than it holds (small groups are always allowed to grow: each call has a fixed cost).
    """
    if rows.size == 0:
        return []
    blocks = blocks_for(ctx_lens[rows], block_size)
    order = np.argsort(blocks, kind="stable")
    groups: list[np.ndarray] = []
    start, total = 0, 0
    for j, idx in enumerate(order.tolist()):
        size = j - start + 1
        total += int(blocks[idx])
        if size > 8 and int(blocks[idx]) * size > 1.25 * total:
            groups.append(rows[order[start:j]])
            start, total = j, int(blocks[idx])
    groups.append(rows[order[start:]])
    return groups


# torch >= 2.5 attends grouped-query heads without repeating the keys.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa(q, k, v, mask, scale, is_causal=False):
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


class TorchReference(AttentionBackend):
    name = "torch"
    option = "torch"
    computes = frozenset({"sliding_window", "bidirectional_window", "image_both_ways"})
    bidirectional = True

    @property
    def reads_cache(self) -> bool:
        # An encoder's rows (both ways, whole, no one-token path) attend the step's own keys: nothing in the
        # cache is read again, so the writes are skipped (1-2.5% of an embedding step on the CPU).
        return self.causal or self.decode_rows

    # -- metadata ----------------------------------------------------------------------------------------

    def single_rows(self, lay: StepLayout) -> np.ndarray:
        """[R] bool: the requests whose rows go through :meth:`pack_decodes` (here: one-token requests)."""
        return (lay.n == 1) & self.decode_rows

    def pack_decodes(self, lay: StepLayout, pk: Packer, single: np.ndarray) -> list[tuple]:
        """Decode groups of the ``single`` requests: (rows, block table, context lengths) handles each."""
        bs, ends, offsets, table = self.block_size, lay.ends, lay.offsets, lay.table
        handles = []
        for rows in decode_groups(np.flatnonzero(single), ends, bs):
            width = int(blocks_for(ends[rows], bs).max())
            handles.append((pk.add(offsets[rows]), pk.add(table[rows, :width]), pk.add(ends[rows])))
        return handles

    def pack(self, lay: StepLayout, pk: Packer) -> Any:  # (decode handles, prefill handles)
        single = self.single_rows(lay)
        decodes = self.pack_decodes(lay, pk, single)
        prefills = []
        for i in np.flatnonzero(~single).tolist():
            ctx = int(lay.ends[i])
            h_blocks = pk.add(lay.table[i, : -(-ctx // self.block_size)]) if lay.starts[i] > 0 else None
            assert self.causal or lay.starts[i] == 0, "a bidirectional row is computed whole, in one step"
            prefills.append((int(lay.offsets[i]), int(lay.n[i]), ctx, h_blocks, self._key_ends(lay, i, pk)))
        return decodes, prefills

    @staticmethod
    def _key_ends(lay: StepLayout, i: int, pk: Packer) -> tuple | None:
        """The handle of request ``i``'s rows' ``key_ends`` where one of them sees past itself, else None."""
        if lay.key_ends is None:
            return None
        s, e = int(lay.offsets[i]), int(lay.offsets[i + 1])
        ends = lay.key_ends[s:e]
        if (ends == lay.positions[s:e] + 1).all():
            return None
        assert ends.max() <= lay.ends[i], "a chunk holds every key its rows see (vision.WholeImages)"
        return pk.add(ends)

    def metadata(self, handles, buf: torch.Tensor) -> SdpaMeta:
        decodes, prefills = handles
        v = Packer.view
        return SdpaMeta(
            [DecodeGroup(*(v(buf, h) for h in hs)) for hs in decodes],
            [
                PrefillChunk(
                    s, n, ctx, None if h is None else v(buf, h), self.causal, None if k is None else v(buf, k)
                )
                for s, n, ctx, h, k in prefills
            ],
        )

    def decode_metadata(self, slots, table, lens) -> SdpaMeta:
        return SdpaMeta([DecodeGroup(torch.arange(table.shape[0], device=self.device), table, lens)], [])

    # -- forward -----------------------------------------------------------------------------------------

    def decode(self, group: DecodeGroup, q, k_cache, v_cache, scale, window) -> torch.Tensor:
        """[G, H, D]: one query per request of the group over its cached keys."""
        num_heads, head_dim = q.shape[0], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        g = group.rows.shape[0]
        # One query per request: fold each KV head's group of query heads into the query axis, so the
        # cached keys are attended without being repeated for grouped-query attention.
        qd = q.index_select(1, group.rows).transpose(0, 1)  # [G, H, D]
        qd = qd.reshape(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
        blocks = group.block_table.reshape(-1)
        kd = k_cache.index_select(0, blocks).view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, blocks).view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
        mask = group.mask(window, self.block_size)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        return od.reshape(g, num_heads, head_dim)

    def forward(
        self,
        data: SdpaMeta,
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
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]
        for group in data.decode_groups:
            out[group.rows] = self.decode(group, q, k_cache, v_cache, scale, window)
        self.prefill(data, q, key, value, k_cache, v_cache, scale, window, out)
        return out

    def prefill(self, data: SdpaMeta, q, key, value, k_cache, v_cache, scale, window, out) -> None:
        """Write the prompt chunks' rows of ``out``: one SDPA call each."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        for chunk in data.prefills:
            s, e = chunk.q_start, chunk.q_start + chunk.q_len
            qp = q[:, s:e].unsqueeze(0)  # [1, H, q, D]
            if chunk.blocks is None:
                kp, vp = key[:, :, s:e], value[:, :, s:e]
            else:
                kp = k_cache.index_select(0, chunk.blocks).view(-1, num_kv_heads, head_dim)[: chunk.ctx_len]
                vp = v_cache.index_select(0, chunk.blocks).view(-1, num_kv_heads, head_dim)[: chunk.ctx_len]
                kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            mask = chunk.mask(window, q.device)
            op = sdpa(qp, kp, vp, mask, scale, is_causal=chunk.causal and mask is None and chunk.q_len > 1)
            out[s:e] = op[0].transpose(0, 1)
