"""CPU-only machinery, switched on here and nowhere else; other devices never reach it.

- :mod:`~batchjob.engine.cpu.kernel`: decode attention compiled on first use (``csrc/paged_decode.cpp``),
  the ``cpu_kernel`` attention backend (chosen with the others in ``attention.choose_attention``).
- :mod:`~batchjob.engine.cpu.linear`: float32 linear layers with weights packed once for oneDNN
  (:func:`prepare_model`, called by the model runner at load).
- :mod:`~batchjob.engine.cpu.spin`: short OpenMP spins while other programs share our CPUs
  (:func:`spin_guard`; ``BATCHJOB_CPU_SPIN_GUARD=0`` turns it off). It stays on by default: on a shared
  machine, ``batchjob bench`` ran 4.5x slower without it (BENCHMARKS.md); on a quiet one it never comes on.
"""

from __future__ import annotations

import torch

from batchjob import env
from batchjob.engine.cpu.spin import SpinGuard

SPIN_GUARD_ENV = "BATCHJOB_CPU_SPIN_GUARD"


def prepare_model(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, compiled: bool) -> int:
    """Pack the model's float32 linear weights for oneDNN on a CPU (not under torch.compile: inductor lowers
    the packed call only for weights it froze itself). Returns how many layers were packed."""
    from batchjob.engine.cpu import linear

    if device.type != "cpu" or compiled or not linear.available(dtype, device):
        return 0
    return linear.prepack_linears(model)


def spin_guard(device: torch.device) -> SpinGuard | None:
    """The spin guard on a CPU device where it can work (Linux, libgomp, more than one thread) and unless
    turned off (``BATCHJOB_CPU_SPIN_GUARD=0``); else None, and the engine never checks it."""
    if device.type != "cpu" or not env.flag(SPIN_GUARD_ENV):
        return None
    guard = SpinGuard(device)
    return guard if guard.enabled else None
