"""The ``cpu_kernel`` attention backend, the CPU default: the torch reference with its single-query rows
sent to the compiled decode kernel (:mod:`.kernel`), which reads the paged cache in place.

The kernel takes rows of any context lengths in one call, so every one-token request and every row of a
draft verification (each query seeing its request's keys up to its own position) goes in one group;
prompt chunks stay the reference's (one SDPA call each). ``BATCHJOB_CPU_KERNEL=0`` turns the kernel off,
and the engine then chooses the reference.
"""

from __future__ import annotations

import numpy as np
import torch

from batchjob.engine.attention.base import blocks_for
from batchjob.engine.attention.layout import Packer, StepLayout, ramps
from batchjob.engine.attention.reference import DecodeGroup, TorchReference
from batchjob.engine.cpu import kernel


class CpuKernel(TorchReference):
    name = "cpu_kernel"
    option = "cpu"
    devices = ("cpu",)
    dtypes = kernel.DTYPES  # float32, float64, bfloat16 (computed in float)

    @classmethod
    def missing(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if kernel.load() is None:
            return (
                f"its C++ kernel is turned off ({kernel.DISABLE_ENV}=0) or could not be built (see the log)"
            )
        return None

    def single_rows(self, lay: StepLayout) -> np.ndarray:
        return ((lay.n == 1) | (lay.drafts > 0)) & self.decode_rows

    def pack_decodes(self, lay: StepLayout, pk: Packer, single: np.ndarray) -> list[tuple]:
        idx = np.flatnonzero(single)
        if not idx.size:
            return []
        n = lay.n[idx]
        within = ramps(n)
        owner = np.repeat(idx, n)
        lens = lay.starts[owner] + within + 1
        width = int(blocks_for(lens, self.block_size).max())
        rows = lay.offsets[owner] + within
        return [(pk.add(rows), pk.add(lay.table[owner, :width]), pk.add(lens))]

    def decode(self, group: DecodeGroup, q, k_cache, v_cache, scale, window) -> torch.Tensor:
        qd = q.index_select(1, group.rows).transpose(0, 1)  # [G, H, D]
        if scale is None:
            scale = q.shape[2] ** -0.5
        return kernel.paged_decode(qd, k_cache, v_cache, group.block_table, group.ctx_lens, scale, window)
