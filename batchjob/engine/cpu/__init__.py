"""CPU-only machinery, switched on here and nowhere else; other devices never reach it.

- :mod:`~batchjob.engine.cpu.platform`: the device hooks the engine calls (:func:`platform`): a
  :class:`~.platform.Platform` that does nothing on CUDA, a :class:`~.platform.CpuPlatform` on the CPU.
- :mod:`~batchjob.engine.cpu.attention`: the ``cpu_kernel`` attention backend (chosen with the others in
  :mod:`batchjob.engine.attention.registry`), over the kernels of :mod:`~batchjob.engine.cpu.kernel`
  (compiled on first use from ``csrc/``: decode rows, and prompt chunks and encoder rows in float32, and in
  bf16 where the CPU has AVX512-BF16; ``BATCHJOB_CPU_KERNEL=0`` turns all off, ``BATCHJOB_CPU_PREFILL=0``
  the prompt kernels).
- :mod:`~batchjob.engine.cpu.tower`: a vision tower's attention on those prompt kernels.
- :mod:`~batchjob.engine.cpu.linear`: linear layers with weights packed once for oneDNN, at load: float32,
  and bf16 where the CPU has native bf16 (``BATCHJOB_CPU_PREPACK=0`` turns it off).
- :mod:`~batchjob.engine.cpu.rows`: a layer's small per-row work in one kernel call each: the attention
  hook's KV writes and the RMS norms of the Llama layout, bit for bit (``BATCHJOB_CPU_ROWS=0`` turns it off).
- :mod:`~batchjob.engine.cpu.bf16`: whether this CPU has native bf16 (:func:`~.bf16.native_bf16`), and the
  one warning line when a model runs in bf16 without it (slower than float32).
- :mod:`~batchjob.engine.cpu.spin`: short OpenMP spins while other programs share our CPUs
  (``BATCHJOB_CPU_SPIN_GUARD=0`` turns it off). It stays on by default: on a shared machine, ``batchjob
  bench`` ran 4.5x slower without it (BENCHMARKS.md); on a quiet one it never comes on.
- :mod:`~batchjob.engine.cpu.heap`: freed forward buffers kept in the heap, not handed back to the OS layer by
  layer (``BATCHJOB_CPU_HEAP=0`` turns it off).
- the KV pool taken page by page as blocks are first written (:func:`~.platform.lazy_zeros`).
"""

from __future__ import annotations

import torch

from batchjob.engine.cpu.platform import SPIN_GUARD_ENV, CpuPlatform, Platform

__all__ = ["SPIN_GUARD_ENV", "CpuPlatform", "Platform", "platform"]


def platform(device: torch.device, spin_guard: bool = False) -> Platform:
    """The device's hooks; ``spin_guard``: on a CPU, watch for other programs (the engine's)."""
    return CpuPlatform(device, spin_guard) if device.type == "cpu" else Platform(device)
