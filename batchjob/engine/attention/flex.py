"""The ``flex`` backend: FlexAttention over the paged cache (:mod:`.flex_kernel`), on every device with
nothing but torch, at any block size; the only one with logit soft-capping and attention sinks; it also
attends an encoder's rows both ways. The
default on CUDA without flash-attn, and wherever a model needs what the others lack.

ALiBi is implemented (``alibi_slopes``) but not declared: no transformers model hands it to the attention
interface (Bloom, Falcon and MPT compute attention inline), so declaring it would wrongly lift their refusal.
"""

from __future__ import annotations

import torch

from batchjob.engine.attention import flex_kernel
from batchjob.engine.attention.base import AttentionBackend
from batchjob.engine.attention.layout import Packer, StepLayout


class Flex(AttentionBackend):
    name = "flex"
    option = "flex"
    computes = frozenset({"sliding_window", "softcap", "sinks"})
    implemented = frozenset({"alibi"})
    bidirectional = True

    def __init__(self, kv_caches, block_size, device, num_heads, max_rows) -> None:
        super().__init__(kv_caches, block_size, device, num_heads, max_rows)
        self.state = self.new_state()

    def new_state(self) -> flex_kernel.FlexState:
        """FlexAttention's state for this cache: the page map, the buffers the compiled mods read, and
        whether the compiled kernel is in use."""
        k = self.kv_caches[0][0]
        return flex_kernel.FlexState(k.shape[0], self.block_size, k.dtype, self.device, self.max_rows)

    def pack(self, lay: StepLayout, pk: Packer) -> list[tuple]:
        """The step's FlexAttention calls (see :func:`~.flex_kernel.plan_calls`), in the packer."""
        group = self.num_heads // self.kv_caches[0][0].shape[2]
        calls = flex_kernel.plan_calls(
            lay.n, lay.starts, lay.offsets, lay.table, self.block_size, self.state.q_block // group + 1
        )
        return [(pk.add(r), pk.add(t), pk.add(s), pk.add(q), n, kind) for r, t, s, q, n, kind in calls]

    def metadata(self, handles, buf: torch.Tensor) -> flex_kernel.FlexMeta:
        v = Packer.view
        sets = [
            flex_kernel.FlexSeqs(v(buf, r).view(-1), v(buf, t), v(buf, s0), v(buf, q), n, kind)
            for r, t, s0, q, n, kind in handles
        ]
        return self.state.begin(sets)

    def decode_metadata(self, slots, table, lens) -> flex_kernel.FlexMeta:
        rows = torch.arange(table.shape[0], device=self.device)
        seqs = flex_kernel.FlexSeqs(rows, table, lens - 1, torch.ones_like(lens), 1, flex_kernel.DECODE)
        return self.state.begin([seqs])

    def forward(
        self, data, q, key, value, k_cache, v_cache, scale, window, softcap=None, slopes=None, sinks=None
    ):
        if scale is None:
            scale = q.shape[2] ** -0.5
        return flex_kernel.paged_flex_attention(
            q, k_cache, v_cache, data, scale, window, softcap, slopes, sinks, self.causal
        )
