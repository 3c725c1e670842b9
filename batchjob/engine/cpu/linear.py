"""Linear layers on the CPU with weights packed once for oneDNN, instead of on every call.

A decode step multiplies a few dozen rows by every weight matrix of the model. At that size the default
CPU path (MKL sgemm) spends much of each call preparing the weight matrix; oneDNN with a weight already in
its own blocked layout skips that. Measured on the default model (2 cores, fp32): a plain oneDNN copy
made decode steps of ~44 requests about 12% faster than MKL; the blocked layout a further 1.1-1.3x (steps of
64 down to 4 rows), large prefill steps the same (BENCHMARKS.md).

Only the layers' ``forward`` changes: the modules, their ``weight`` parameters and the model's code stay as
they are (the packed copy is extra memory, the size of the linear weights). float32 everywhere, bfloat16
where the CPU has native bf16 (:func:`~.bf16.native_bf16`: AVX512-BF16 or AMX; the same two oneDNN ops, as
torch's inductor packs bf16 linears on the CPU); not float64: oneDNN has no float64 path, and the exactness
tests run in float64 through the plain layers. ``BATCHJOB_CPU_PREPACK=0`` turns it off.
"""

from __future__ import annotations

import types

import torch

from batchjob import env
from batchjob.engine.cpu.bf16 import native_bf16

DISABLE_ENV = "BATCHJOB_CPU_PREPACK"


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are packed on this CPU: float32, and bf16 where the CPU has native bf16."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def available(dtype: torch.dtype, device: torch.device) -> bool:
    if not env.flag(DISABLE_ENV):  # on unless turned off
        return False
    return device.type == "cpu" and packs(dtype) and torch.backends.mkldnn.is_available()


PACK_ROWS_HINT = 64  # rows per call oneDNN lays the weight out for (a decode step's size; any size works)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout for its matmul kernel. A plain ``to_mkldnn()`` copy keeps the
    row-major layout, which oneDNN re-blocks on every call; the blocked one makes calls of a few dozen rows
    1.1-1.6x faster in microbenchmarks (the output head of a decode step too), large calls the same."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:
        return weight.to_mkldnn()
    return reorder(weight, PACK_ROWS_HINT)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self._batchjob_packed, self.bias, "none", [], "")


@torch.no_grad()
def prepack_linears(model: torch.nn.Module) -> int:
    """Give every float32 ``nn.Linear`` of the model (and bf16 one, on a CPU with native bf16) a packed weight
    and the forward that uses it. Returns how many layers were packed (0 where oneDNN refuses the weight)."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or not packs(module.weight.dtype):
            continue
        if hasattr(module, "_batchjob_packed"):
            count += 1
            continue
        try:
            module._batchjob_packed = _pack(module.weight.detach())
        except RuntimeError:
            continue
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    return count
