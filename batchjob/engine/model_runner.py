"""Turns a scheduler plan into one packed forward of the unmodified Hugging Face model.

All scheduled tokens of all requests form one sequence of length T (batch dimension 1) with per-token
``position_ids``; the paged attention hook reads the batch layout from one metadata object built here once
per step. Logits are computed only for the rows that sample: the last token of each request whose chunk
reaches the end of its known tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from batchjob.engine import attention
from batchjob.engine.attention import AttentionMetadata, PrefillChunk
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.forward_seconds = 0.0  # time inside the model forward (for the benchmark's breakdown)
        model.set_attn_implementation(attention.ATTN_NAME)

    def _prepare(self, plan: SchedulerOutput):
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
        sample_rows = offsets[1:][sample_mask] - 1

        dev = self.device
        meta = AttentionMetadata(kv_caches=self.kv_caches, slot_mapping=torch.from_numpy(slots).to(dev))

        decode = np.flatnonzero(n == 1)
        if decode.size:
            lens = ends[decode]
            lmax = int(lens.max())
            kpos = np.arange(lmax, dtype=np.int64)
            tab = table[decode]
            key_slots = tab[:, kpos // bs] * bs + kpos % bs  # padding reads real (masked) slots
            meta.decode_rows = torch.from_numpy(offsets[decode]).to(dev)
            meta.decode_key_slots = torch.from_numpy(key_slots).to(dev)
            meta.decode_ctx_lens = torch.from_numpy(lens).to(dev)
        for i in np.flatnonzero(n > 1).tolist():
            ctx = int(ends[i])
            key_slots = None
            if starts[i] > 0:
                kpos = np.arange(ctx, dtype=np.int64)
                key_slots = torch.from_numpy(table[i, kpos // bs] * bs + kpos % bs).to(dev)
            meta.prefills.append(PrefillChunk(int(offsets[i]), int(n[i]), ctx, key_slots))

        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)[None]
        position_ids = torch.from_numpy(positions).to(dev)[None]
        return input_ids, position_ids, meta, torch.from_numpy(sample_rows).to(dev), sample_mask

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run the plan; returns logits [R, V] for the requests that sample, and those requests in order."""
        input_ids, position_ids, meta, sample_rows, sample_mask = self._prepare(plan)
        t0 = time.perf_counter()
        out = self.model(
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
        sampling = [r for r, m in zip(plan.requests, sample_mask.tolist(), strict=True) if m]
        return logits, sampling
