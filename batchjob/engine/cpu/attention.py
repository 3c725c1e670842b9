"""The ``cpu_kernel`` attention backend, the CPU default: the torch reference with its single-query rows
sent to the compiled decode kernel (:mod:`.kernel`), which reads the paged cache in place.

The kernel takes rows of any context lengths in one call, so every one-token request and every row of a
draft verification (each query seeing its request's keys up to its own position) goes in one group.
Prompt chunks go to a prefill kernel, all of a step's in one call (float32 everywhere, bfloat16 on a CPU with
AVX512-BF16), with their layer's sliding window and each row's own key end (Gemma 3's image tokens see their
image whole), and so do an encoder's rows, attended both ways over the step's own keys (within a window
both ways where the layer has one); elsewhere (float64, bf16 on other CPUs) they stay the reference's, one
SDPA call each.
``BATCHJOB_CPU_KERNEL=0`` turns the kernels off, and the engine then chooses the reference;
``BATCHJOB_CPU_PREFILL=0`` the prefill kernels alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.attention.base import blocks_for
from batchjob.engine.attention.layout import Packer, StepLayout, ramps
from batchjob.engine.attention.reference import DecodeGroup, SdpaMeta, TorchReference
from batchjob.engine.cpu import kernel, rows


@dataclass
class CpuMeta(SdpaMeta):
    # The step's prompt chunks for the prefill kernel: block table, first rows, rows, keys; None: SDPA.
    chunks: tuple[torch.Tensor, ...] | None = None
    key_ends: torch.Tensor | None = None  # [T] int64 StepLayout.key_ends, where a row sees past itself
    whole: bool = False  # every row of the step is a single query, in the one decode group, in order


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

    @functools.cached_property
    def prefill_kernel(self) -> bool:
        """Whether prompt chunks (or an encoder's rows) can go to the prefill kernel: this dtype and head size."""
        k_cache = self.kv_caches[0][0] if self.kv_caches else None
        return k_cache is not None and kernel.prefill_takes(k_cache.dtype, k_cache.shape[3])

    @functools.cached_property
    def writes_kv(self) -> bool:
        """Whether :meth:`write_kv` copies on the kernel library (:mod:`.rows`, where its inputs allow)."""
        return rows.available()

    def write_kv(self, key, value, slots, k_cache, v_cache) -> None:
        if (
            self.writes_kv
            and key.dtype == value.dtype == k_cache.dtype
            and key.stride(3) == value.stride(3) == 1
        ):
            rows.write_kv(key, value, slots, k_cache, v_cache)
        else:
            super().write_kv(key, value, slots, k_cache, v_cache)

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

    def decode(self, group: DecodeGroup, q, k_cache, v_cache, scale, window, whole=False) -> torch.Tensor:
        qd = (q if whole else q.index_select(1, group.rows)).transpose(0, 1)  # [G, H, D]
        if scale is None:
            scale = q.shape[2] ** -0.5
        return kernel.paged_decode(qd, k_cache, v_cache, group.block_table, group.ctx_lens, scale, window)

    def pack(
        self, lay: StepLayout, pk: Packer
    ) -> tuple[list[tuple], list[tuple], tuple | None, tuple | None, bool]:
        decodes, prefills = super().pack(lay, pk)
        whole = not prefills and len(decodes) == 1  # pack_decodes: the single requests' rows, in order
        chunks = key_ends = None
        if prefills and self.prefill_kernel:
            idx = np.flatnonzero(~self.single_rows(lay))
            width = int(blocks_for(lay.ends[idx], self.block_size).max())
            chunks = tuple(
                pk.add(a) for a in (lay.table[idx, :width], lay.offsets[idx], lay.n[idx], lay.ends[idx])
            )
            if lay.key_ends is not None:  # a row sees past itself
                key_ends = pk.add(lay.key_ends)
        return decodes, prefills, chunks, key_ends, whole

    def metadata(self, handles, buf: torch.Tensor) -> CpuMeta:
        decodes, prefills, chunks, key_ends, whole = handles
        meta = super().metadata((decodes, prefills), buf)
        views = None if chunks is None else tuple(Packer.view(buf, h) for h in chunks)
        ends = None if key_ends is None else Packer.view(buf, key_ends)
        return CpuMeta(meta.decode_groups, meta.prefills, views, ends, whole)

    def decode_metadata(self, slots, table, lens) -> CpuMeta:
        return CpuMeta(super().decode_metadata(slots, table, lens).decode_groups, [])

    def forward(self, data: SdpaMeta, q, key, value, k_cache, v_cache, scale, window, *rest):
        # Every row a decode row, in order: the kernel's rows are the step's, no gather and no scatter.
        if isinstance(data, CpuMeta) and data.whole:
            return self.decode(data.decode_groups[0], q, k_cache, v_cache, scale, window, whole=True)
        return super().forward(data, q, key, value, k_cache, v_cache, scale, window, *rest)

    def prefill(self, data: SdpaMeta, q, key, value, k_cache, v_cache, scale, window, out) -> None:
        if not isinstance(data, CpuMeta) or data.chunks is None:
            super().prefill(data, q, key, value, k_cache, v_cache, scale, window, out)
            return
        table, starts, lens, ends = data.chunks
        scale = q.shape[2] ** -0.5 if scale is None else scale
        if self.causal:
            kernel.paged_prefill(
                q, k_cache, v_cache, table, starts, lens, ends, scale, out, window, data.key_ends
            )
        else:  # an encoder's whole rows, both ways, over the step's keys (the cache is not written)
            kernel.dense_prefill(q, key[0], value[0], starts, lens, scale, False, out, window)
