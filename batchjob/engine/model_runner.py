"""Turns a scheduler plan into one packed forward of the unmodified Hugging Face model.

All scheduled tokens of all requests form one sequence of length T (batch dimension 1) with per-token
``position_ids``; the paged attention hook reads the batch layout from one metadata object built here once
per step. Every index array of the step is packed into one host buffer and moved to the device with a single
copy. Logits are computed only for the rows that sample: the last token of each request whose chunk reaches
the end of its known tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine import attention, cpu, flex
from batchjob.engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from batchjob.engine.graphs import ROW_BUCKETS, DecodeGraphs
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class _Packer:
    """Collects int64 arrays, sends them to the device in one copy, hands back device views."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0

    def add(self, a: np.ndarray) -> tuple[int, tuple[int, ...]]:
        a = np.ascontiguousarray(a, dtype=np.int64)
        handle = (self._size, a.shape)
        self._parts.append(a.ravel())
        self._size += a.size
        return handle

    def send(self, device: torch.device) -> torch.Tensor:
        buf = torch.from_numpy(np.concatenate(self._parts) if self._parts else np.zeros(0, np.int64))
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        return buf

    @staticmethod
    def view(buf: torch.Tensor, handle: tuple[int, tuple[int, ...]]) -> torch.Tensor:
        start, shape = handle
        return buf[start : start + int(np.prod(shape, dtype=np.int64))].view(shape)


def _decode_groups(rows: np.ndarray, ctx_lens: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Split single-token requests into groups of similar length, so padding to the longest wastes little.

    Sorted by length, a group grows while padding all of it to its longest member costs at most a quarter
    more blocks than it holds (small groups are always allowed to grow: each call has a fixed cost).
    """
    if rows.size == 0:
        return []
    blocks = -(-ctx_lens[rows] // block_size)
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


def _ramps(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c - 1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass
class _Layout:
    ids: np.ndarray  # [T] token of each packed row
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] flat KV slot each row's key and value go to
    table: np.ndarray  # [R, max_blocks] block table of each request (0-padded)
    req_of_row: np.ndarray  # [T]
    starts: np.ndarray  # [R] tokens computed before this step
    n: np.ndarray  # [R] rows this step
    ends: np.ndarray  # [R]
    offsets: np.ndarray  # [R + 1] first row of each request
    drafts: np.ndarray  # [R] drafts each request verifies
    sample_mask: np.ndarray  # [R] whether the request samples this step
    sample_rows: np.ndarray  # [S] rows whose logits are sampled

    @property
    def decode_like(self) -> bool:
        """Every row is a single query over its own request's keys: no prompt chunk in the step."""
        return bool(((self.n == 1) | (self.drafts > 0)).all())


class _HandOver:
    """Forward pre-hooks that hand the step's metadata to the modules our attention serves (those with a
    ``layer_idx``) when their caller did not pass it on: some models' layers call their attention without the
    keyword arguments they were given (StableLM; transformers marks such a model not "backend compatible").
    Installed once per model; the runner sets ``meta`` for the length of each forward."""

    def __init__(self) -> None:
        self.meta: AttentionMetadata | None = None

    @classmethod
    def install(cls, model) -> _HandOver | None:
        if model.is_backend_compatible():
            return None
        hand_over = getattr(model, "_batchjob_hand_over", None)
        if hand_over is None:
            hand_over = model._batchjob_hand_over = cls()
            for module in model.modules():
                if isinstance(getattr(module, "layer_idx", None), int):
                    module.register_forward_pre_hook(hand_over, with_kwargs=True)
        return hand_over

    def __call__(self, module, args, kwargs):
        if kwargs.get(attention.META_KWARG) is None and self.meta is not None:
            kwargs[attention.META_KWARG] = self.meta
        return args, kwargs


class ModelRunner:
    """Runs scheduler plans through the model.

    ``scratch_block``: a KV block no request owns; with it, steps without prompt chunks go through
    :class:`~batchjob.engine.graphs.DecodeGraphs` (CUDA graphs on a GPU, the same padded buffers eagerly on
    the CPU). ``compile_model``: the model runs under ``torch.compile``, attention left out of the graph.
    ``attention_backend``: force one (see :func:`~batchjob.engine.attention.choose_attention`, which
    otherwise picks by device, dtype and what the model needs).
    """

    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        device: torch.device,
        *,
        scratch_block: int | None = None,
        max_graph_rows: int = ROW_BUCKETS[-1],
        max_model_len: int = 2048,
        compile_model: bool = False,
        attention_backend: str | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        kv_dtype = kv_caches[0][0].dtype if kv_caches else dtype
        self.features = attention.attention_features(model.config, model)
        choice = attention.choose_attention(device, kv_dtype, self.features, block_size, attention_backend)
        self.backend = choice.backend
        # The flash-attn metadata (cu_seqlens, int32 block tables): flash-attn's kernel, or torch's varlen.
        self.use_flash = self.backend in ("flash_attn", "varlen")
        self.decode_kernel = self.backend == "cpu_kernel"
        self._max_rows = max(max_graph_rows, ROW_BUCKETS[-1])  # rows one step can have
        self.flex = self.new_flex_state() if self.backend == "flex" else None
        self.forward_seconds = 0.0  # time inside the model forward (for the benchmark's breakdown)
        self.packed_linears = cpu.prepare_model(model, dtype, device, compile_model)  # CPU, float32 only
        # transformers' MoE experts default to grouped_mm, which has no float64 kernel; its eager loop has.
        if dtype == torch.float64 and getattr(model.config, "_experts_implementation", None) == "grouped_mm":
            model.set_experts_implementation("eager")
        self.hand_over = _HandOver.install(model)
        if compile_model:
            # Attention stays eager (its batch layout is Python data, fresh every step); the layers between
            # attentions compile with dynamic lengths.
            model.set_attn_implementation(attention.ATTN_NAME_UNCOMPILED)
            self.forward = torch.compile(model, dynamic=True)
        else:
            model.set_attn_implementation(attention.ATTN_NAME)
            self.forward = model
        self.graphs: DecodeGraphs | None = None
        if scratch_block is not None:
            self.graphs = DecodeGraphs(self, scratch_block, max_graph_rows, -(-max_model_len // block_size))

    def _layout(self, plan: SchedulerOutput) -> _Layout:
        """The step's host-side index arrays (numpy)."""
        bs = self.block_size
        reqs, counts = plan.requests, plan.num_tokens
        starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        n = np.array(counts, dtype=np.int64)
        ends = starts + n
        offsets = np.concatenate([[0], np.cumsum(n)])  # first packed row of each request
        total = int(offsets[-1])

        ids: list[int] = []
        for r, s, e in zip(reqs, starts.tolist(), ends.tolist(), strict=True):
            ids.extend(r.token_ids[s:e])
        req_of_row = np.repeat(np.arange(len(reqs)), n)
        positions = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1] - starts, n)

        max_blocks = max(len(r.block_ids) for r in reqs)
        table = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = r.block_ids
        slots = table[req_of_row, positions // bs] * bs + positions % bs

        sample_mask = np.array([e == r.num_tokens for r, e in zip(reqs, ends.tolist(), strict=True)])
        # A request verifying d drafts samples its last d + 1 rows; any other, its last row.
        drafts = np.array([r.num_draft_tokens for r in reqs], dtype=np.int64)
        per = drafts[sample_mask] + 1
        sample_rows = np.repeat(offsets[1:][sample_mask] - per, per) + _ramps(per)
        return _Layout(
            np.array(ids, dtype=np.int64),
            positions,
            slots,
            table,
            req_of_row,
            starts,
            n,
            ends,
            offsets,
            drafts,
            sample_mask,
            sample_rows,
        )

    def _prepare(self, plan: SchedulerOutput, lay: _Layout | None = None):
        lay = lay or self._layout(plan)
        bs = self.block_size
        table, starts, n, ends, offsets = lay.table, lay.starts, lay.n, lay.ends, lay.offsets
        pk = _Packer()
        h_ids, h_pos, h_slots, h_sample = (
            pk.add(lay.ids),
            pk.add(lay.positions),
            pk.add(lay.slots),
            pk.add(lay.sample_rows),
        )
        h_decode: list[tuple] = []
        h_prefill: list[tuple[int, int, int, tuple | None]] = []
        h_flash = None
        h_flex: list[tuple] = []
        if self.flex is not None:
            h_flex = self._flex_sets(lay, pk)
        elif self.use_flash:
            cu_q = offsets
            cu_k = np.concatenate([[0], np.cumsum(ends)])
            h_flash = (pk.add(cu_q), pk.add(cu_k), pk.add(table), int(n.max()), int(ends.max()))
        else:
            single = n == 1
            if self.decode_kernel:
                # The kernel takes rows of any lengths at once: every one-token request, and every row of a
                # draft verification (each query sees its request's keys up to its own position).
                single |= lay.drafts > 0
                idx = np.flatnonzero(single)
                if idx.size:
                    within = _ramps(n[idx])
                    owner = np.repeat(idx, n[idx])
                    lens = starts[owner] + within + 1
                    nblk = int((-(-lens // bs)).max())
                    rows = offsets[owner] + within
                    h_decode.append((pk.add(rows), pk.add(table[owner, :nblk]), pk.add(lens)))
            else:  # the reference pads a group's keys to its longest: group by length
                for rows in _decode_groups(np.flatnonzero(single), ends, bs):
                    nblk = -(-ends[rows] // bs)
                    h_decode.append(
                        (pk.add(offsets[rows]), pk.add(table[rows, : int(nblk.max())]), pk.add(ends[rows]))
                    )
            for i in np.flatnonzero(~single).tolist():
                ctx = int(ends[i])
                h_blocks = pk.add(table[i, : -(-ctx // bs)]) if starts[i] > 0 else None
                h_prefill.append((int(offsets[i]), int(n[i]), ctx, h_blocks))

        buf = pk.send(self.device)
        v = pk.view
        meta = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=v(buf, h_slots),
            decode_kernel=self.decode_kernel,
            varlen=self.backend == "varlen",
        )
        if self.flex is not None:
            sets = [
                flex.FlexSeqs(v(buf, r).view(-1), v(buf, t), v(buf, s0), v(buf, q), n, kind)
                for r, t, s0, q, n, kind in h_flex
            ]
            meta.flex = self.flex.begin(sets)
        meta.decode_groups = [DecodeGroup(*(v(buf, h) for h in hs)) for hs in h_decode]
        for q_start, q_len, ctx, h in h_prefill:
            meta.prefills.append(PrefillChunk(q_start, q_len, ctx, None if h is None else v(buf, h)))
        if h_flash is not None:
            cu_q, cu_k, tab, max_q, max_k = h_flash
            meta.flash = (
                v(buf, cu_q).to(torch.int32),
                v(buf, cu_k).to(torch.int32),
                v(buf, tab).to(torch.int32),
                max_q,
                max_k,
            )
        return v(buf, h_ids)[None], v(buf, h_pos)[None], meta, v(buf, h_sample)

    def new_flex_state(self) -> flex.FlexState:
        """FlexAttention's state for this runner's cache (examples/attention_ab.py swaps one in and out)."""
        k = self.kv_caches[0][0]
        return flex.FlexState(k.shape[0], self.block_size, k.dtype, self.device, self._max_rows)

    def _flex_sets(self, lay: _Layout, pk: _Packer) -> list[tuple]:
        """The step's FlexAttention calls (see :func:`~batchjob.engine.flex.plan_calls`), in the packer."""
        heads = self.model.config.get_text_config().num_attention_heads
        group = heads // self.kv_caches[0][0].shape[2]
        calls = flex.plan_calls(
            lay.n, lay.starts, lay.offsets, lay.table, self.block_size, self.flex.q_block // group + 1
        )
        return [(pk.add(r), pk.add(t), pk.add(s), pk.add(q), n, kind) for r, t, s, q, n, kind in calls]

    def decode_meta(self, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
        """Metadata of a step whose row i is one query at position ``lens[i] - 1`` attending through block
        table ``table[i]`` (the padded buffers of a decode graph; device tensors, so it can be captured)."""
        rows = table.shape[0]
        meta = AttentionMetadata(
            self.kv_caches,
            slot_mapping=slots,
            decode_kernel=self.decode_kernel,
            varlen=self.backend == "varlen",
        )
        if self.use_flash:
            cu_q = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
            cu_k = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
            meta.flash = (cu_q, cu_k, table.to(torch.int32), 1, table.shape[1] * self.block_size)
        elif self.flex is not None:
            seqs = flex.FlexSeqs(
                torch.arange(rows, device=self.device), table, lens - 1, torch.ones_like(lens), 1, flex.DECODE
            )
            meta.flex = self.flex.begin([seqs])
        else:
            meta.decode_groups = [DecodeGroup(torch.arange(rows, device=self.device), table, lens)]
        return meta

    def call_model(self, **kwargs):
        """The model's forward. Should torch.compile fail, the model runs eagerly from then on (one warning):
        a real error of the forward then raises from the eager call, unmasked."""
        if self.hand_over is None:
            return self._call_model(**kwargs)
        self.hand_over.meta = kwargs.get(attention.META_KWARG)
        try:
            return self._call_model(**kwargs)
        finally:
            self.hand_over.meta = None

    def _call_model(self, **kwargs):
        if self.forward is self.model:
            return self.model(**kwargs)
        try:
            return self.forward(**kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - compiler errors come in many types
            log.warning("torch.compile failed (%s: %s); the model runs eagerly", type(e).__name__, e)
            self.forward = self.model
            return self.model(**kwargs)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run the plan; returns logits [R, V] for the requests that sample, and those requests in order."""
        lay = self._layout(plan)
        logits = None
        if self.graphs is not None and lay.decode_like:
            t0 = time.perf_counter()
            logits = self.graphs.run(lay.ids, lay.positions, lay.slots, lay.table[lay.req_of_row])
            if logits is not None and len(lay.sample_rows) < len(lay.ids):
                logits = logits.index_select(0, torch.from_numpy(lay.sample_rows).to(self.device))
        if logits is None:
            input_ids, position_ids, meta, sample_rows = self._prepare(plan, lay)
            t0 = time.perf_counter()
            out = self.call_model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=sample_rows,
                **{attention.META_KWARG: meta},
            )
            logits = out.logits[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        sampling = [r for r, m in zip(plan.requests, lay.sample_mask.tolist(), strict=True) if m]
        return logits, sampling
