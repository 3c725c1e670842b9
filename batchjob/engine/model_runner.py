"""Turns a scheduler plan into one packed forward of the unmodified Hugging Face model.

All scheduled tokens of all requests form one sequence of length T (batch dimension 1) with per-token
``position_ids``. The runner lays the step out once (:class:`~batchjob.engine.attention.StepLayout`), its
attention backend (chosen at load, :mod:`batchjob.engine.attention.registry`) builds its own metadata from
that layout, and the paged attention hook hands it to the backend in every layer. Every index array of the
step is packed into one host buffer and moved to the device with a single copy. Logits are computed only for the rows that sample: the last token of each request whose chunk reaches
the end of its known tokens.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from batchjob.engine import attention, cpu, vision
from batchjob.engine.attention import AttentionBackend, AttentionMetadata, Packer, StepLayout
from batchjob.engine.attention.layout import ramps
from batchjob.engine.attention.registry import backend_class, choose_attention
from batchjob.engine.config import KVShape
from batchjob.engine.graphs import ROW_BUCKETS, DecodeGraphs
from batchjob.engine.lora import LoraStep
from batchjob.engine.parallel.group import HIDDEN, LOGITS
from batchjob.engine.request import Request
from batchjob.engine.rope import LongRope
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.support import attention_features

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduler plans through the model.

    ``scratch_block``: a KV block no request owns; with it, steps without prompt chunks go through
    :class:`~batchjob.engine.graphs.DecodeGraphs` (CUDA graphs on a GPU, the same padded buffers eagerly on
    the CPU). ``compile_model``: the model runs under ``torch.compile``, attention left out of the graph.
    ``attention_backend``: the engine option (see :func:`~batchjob.engine.attention.registry.choose_attention`,
    which for None or "auto" picks by device, dtype and what the model needs). ``platform``: the device's
    hooks (:func:`batchjob.engine.cpu.platform`).
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
        platform: cpu.Platform | None = None,
        tensor_parallel=None,
    ) -> None:
        self.model = model
        # Whether one-token rows take the backends' decode path (AttentionBackend.decode_rows); off
        # (``rows_alike``) where a row's values must never depend on which rows share its step.
        self.decode_rows = True
        # Under tensor parallelism (engine/parallel/): this rank's group; rank 0 sends it each step's layout.
        self.tensor_parallel = tensor_parallel
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        kv_dtype = kv_caches[0][0].dtype if kv_caches else dtype
        attention.number_layers(model)  # (before the features are read from the layers)
        self.features = attention_features(model.config, model)
        choice = choose_attention(device, kv_dtype, self.features, block_size, attention_backend)
        self._max_rows = max(max_graph_rows, ROW_BUCKETS[-1])  # rows one step can have
        # An encoder attends within each row both ways (the backend chosen has ``bidirectional``).
        self.causal = "bidirectional" not in self.features
        self.position_offset = 0  # added to ``hidden_states``' position ids (the task engine sets RoBERTa's)
        self.attention: AttentionBackend = self.new_backend(choice.backend)
        self.forward_seconds = 0.0  # time inside the model forward (for the benchmark's breakdown)
        self.platform = platform or cpu.platform(device)
        self.packed_linears = self.platform.prepare_model(model, dtype, compile_model)
        # transformers' MoE experts default to grouped_mm, which has no float64 kernel; its eager loop has.
        if dtype == torch.float64 and getattr(model.config, "_experts_implementation", None) == "grouped_mm":
            model.set_experts_implementation("eager")
        # A longrope model's frequencies picked per row where its context passes their switch (rope.py).
        self.rope = LongRope.install(model, max_model_len)
        if compile_model:
            # Attention stays eager (its batch layout is Python data, fresh every step); the layers between
            # attentions compile with dynamic lengths.
            model.set_attn_implementation(vision.attn_implementation(model, attention.ATTN_NAME_UNCOMPILED))
            self.forward = torch.compile(model, dynamic=True)
        else:
            model.set_attn_implementation(vision.attn_implementation(model, attention.ATTN_NAME))
            self.forward = model
        self.lora: LoraStep | None = None  # with LoRA adapters (engine/lora/): the step's rows by adapter
        self.vision: vision.VisionStep | None = None  # a vision-language model's (engine/vision/): image rows
        self.graphs: DecodeGraphs | None = None
        if scratch_block is not None:
            self.graphs = DecodeGraphs(self, scratch_block, max_graph_rows, -(-max_model_len // block_size))

    def new_backend(self, name: str) -> AttentionBackend:
        """A backend over this runner's cache, unchecked: :func:`choose_attention` has checked the one the
        runner starts with (tests and ``measurements/attention_ab.py`` swap ``self.attention`` for another)."""
        heads = self.model.config.get_text_config().num_attention_heads
        if (
            self.kv_caches
        ):  # a tensor-parallel rank's cache holds 1/N of the KV heads: it has 1/N of the queries
            heads = (
                heads * self.kv_caches[0][0].shape[2] // KVShape.from_config(self.model.config).num_kv_heads
            )
        backend = backend_class(name)(self.kv_caches, self.block_size, self.device, heads, self._max_rows)
        backend.causal = self.causal
        backend.decode_rows = self.decode_rows
        return backend

    def rows_alike(self) -> None:
        """From now on attend every row the same way whatever shares its step: one-token rows go the way
        of prompt chunks (a hook for an engine whose floats must not depend on the batch)."""
        self.decode_rows = False
        self.attention.decode_rows = False

    def _layout(self, plan: SchedulerOutput) -> StepLayout:
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
        sample_rows = np.repeat(offsets[1:][sample_mask] - per, per) + ramps(per)
        adapters = None if self.lora is None else np.repeat([r.adapter for r in reqs], n).astype(np.int64)
        images = None if self.vision is None else self.vision.rows(reqs, starts, ends, offsets)
        long_rope = None if self.rope is None else self.rope.flags(reqs, n)
        return StepLayout(
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
            adapters,
            images,
            None if images is None else images.key_ends,
            long_rope,
        )

    def _prepare(self, plan: SchedulerOutput | None, lay: StepLayout | None = None):
        """The step's input ids, positions, attention metadata and sampled rows, on the device (one copy)."""
        if lay is None:
            assert plan is not None
            lay = self._layout(plan)
        pk = Packer()
        h_ids, h_pos, h_slots, h_sample = (
            pk.add(lay.ids),
            pk.add(lay.positions),
            pk.add(lay.slots),
            pk.add(lay.sample_rows),
        )
        handles = self.attention.pack(lay, pk)
        buf = pk.send(self.device)
        v = pk.view
        meta = AttentionMetadata(
            self.kv_caches, v(buf, h_slots), self.attention, self.attention.metadata(handles, buf)
        )
        return v(buf, h_ids)[None], v(buf, h_pos)[None], meta, v(buf, h_sample)

    def decode_meta(self, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
        """Metadata of a step whose row i is one query at position ``lens[i] - 1`` attending through block
        table ``table[i]`` (the padded buffers of a decode graph; device tensors, so it can be captured)."""
        data = self.attention.decode_metadata(slots, table, lens)
        return AttentionMetadata(self.kv_caches, slots, self.attention, data)

    def call_model(self, **kwargs):
        """The model's forward. Should torch.compile fail, the model runs eagerly from then on (one warning):
        a real error of the forward then raises from the eager call, unmasked."""
        with attention.in_progress(kwargs[attention.META_KWARG]):
            return self._call_model(**kwargs)

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
    def hidden_states(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepLayout]:
        """Run the plan through the model's body (``base_model``: no head); returns the last hidden states
        [T, H] of every packed row, and the step's layout (the prefill-only tasks, engine/tasks/)."""
        lay = self._layout(plan)
        self._share(HIDDEN, lay)
        return self._hidden(lay), lay

    def _hidden(self, lay: StepLayout) -> torch.Tensor:
        if self.lora is not None:
            self.lora.set(lay.adapter_of_row)
        if self.rope is not None:
            self.rope.set(lay.long_rope, self.device)
        input_ids, position_ids, meta, _ = self._prepare(None, lay)
        t0 = time.perf_counter()
        if self.position_offset:
            position_ids = position_ids + self.position_offset
        with attention.in_progress(meta):
            out = self.model.base_model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                **{attention.META_KWARG: meta},
            )
        hidden = out.last_hidden_state[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        return hidden

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run the plan; returns logits [R, V] for the requests that sample, and those requests in order."""
        lay = self._layout(plan)
        self._share(LOGITS, lay)
        logits = self._logits(lay)
        sampling = [r for r, m in zip(plan.requests, lay.sample_mask.tolist(), strict=True) if m]
        return logits, sampling

    def _logits(self, lay: StepLayout) -> torch.Tensor:
        logits = None
        if self.lora is not None:
            self.lora.set(lay.adapter_of_row)
        if self.rope is not None:
            self.rope.set(lay.long_rope, self.device)
        if self.graphs is not None and lay.decode_like and lay.images is None and lay.long_rope is None:
            t0 = time.perf_counter()
            logits = self.graphs.run(lay.ids, lay.positions, lay.slots, lay.table[lay.req_of_row])
            if logits is not None and len(lay.sample_rows) < len(lay.ids):
                logits = logits.index_select(0, torch.from_numpy(lay.sample_rows).to(self.device))
        if logits is None:
            input_ids, position_ids, meta, sample_rows = self._prepare(None, lay)
            t0 = time.perf_counter()
            tokens = {"input_ids": input_ids}
            if lay.images is not None:  # image features in their rows, a family's positions (vision/)
                assert self.vision is not None
                tokens, position_ids = self.vision.inputs(input_ids, position_ids, lay.images)
            out = self.call_model(
                **tokens,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=sample_rows,
                **{attention.META_KWARG: meta},
            )
            logits = out.logits[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        return logits

    # -- tensor parallelism: every forward of a step runs on every rank ---------------------------------

    def _share(self, kind: int, lay: StepLayout) -> None:
        """Rank 0: send the step's layout to the other ranks before its forward (nothing without TP)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_step(kind, lay)

    @torch.inference_mode()
    def run_layout(self, kind: int, lay: StepLayout) -> None:
        """Another rank: run the forward rank 0 announced (its outputs are rank 0's to use)."""
        if kind == HIDDEN:
            self._hidden(lay)
        else:
            self._logits(lay)
