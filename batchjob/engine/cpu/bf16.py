"""Whether this CPU computes bfloat16 in its own instructions, the one answer every bf16 path asks.

oneDNN has bf16 kernels on CPUs with AVX512-BF16 or AMX (and emulates them on AVX-512 BW/VL/DQ and
AVX-NE-CONVERT); torch says whether it will use them with ``torch.ops.mkldnn._is_mkldnn_bf16_supported``.
Where it won't, a bf16 matmul runs on torch's generic path, converting every element, and is far slower than
float32: the engine still runs bf16 there (a user may want its numerics) but says once what it costs. The same
goes for float16, which torch runs fast on a CPU only where oneDNN has float16 kernels for it (AMX-FP16).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

# Measured with measurements/bf16_agreement.py on a 2-core AMD EPYC with AVX2 and FMA, no AVX-512 (the default
# model, a busy machine): 48 chat rows 6.0 vs 25.0 and 8.5 vs 21.3 generated tok/s in two runs, the quick
# start job 309 vs 80 s and 501 vs 128 s; on a quiet machine, 40 x 160 + 40 tokens of the bench 125.4 vs 27.8 s
# (measurements/sizes_table.py, BENCHMARKS.md); per linear layer of
# Qwen2.5-0.5B's MLP shape 2.7x (16 rows) to 7.8x (512 rows) slower than float32's packed one.
SLOW_BF16 = (
    "dtype bfloat16: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 matmuls run on torch's generic "
    "path, {cost}; float32 is faster here (bf16 is kept for its numerics)"
)
MEASURED_COST = "measured 2.5-4.5x slower than float32 end to end on such a CPU (SmolLM2-135M, 2 AVX2 cores)"
# Issue 31: a small job on the same 2-core AVX2 machine, 42.8 s in float16 against 0.5 s in float32.
SLOW_FP16 = (
    "dtype float16: this CPU has no native float16 (AMX-FP16), so float16 matmuls run on torch's generic path, "
    "measured ~85x slower than float32 on such a CPU (42.8 vs 0.5 s, a small job); float32 is faster here"
)


@functools.cache
def native_bf16() -> bool:
    """True where oneDNN runs bf16 on this CPU's own instructions (the prepacked linears need it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported is not None and supported())


@functools.cache
def native_fp16() -> bool:
    """True where oneDNN runs float16 on this CPU's own instructions."""
    if not torch.backends.mkldnn.is_available():
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return bool(supported is not None and supported())


def slow_bf16(device: torch.device, dtype: torch.dtype) -> str | None:
    """The warning line for a model in bf16 (or float16) on a CPU without native bf16 (float16); None
    anywhere else."""
    if device.type == "cpu" and dtype == torch.float16 and not native_fp16():
        return SLOW_FP16
    if device.type != "cpu" or dtype != torch.bfloat16 or native_bf16():
        return None
    return SLOW_BF16.format(cost=MEASURED_COST)


# Measured with measurements/sizes_table.py, ours alone, float32 against bf16 (BENCHMARKS.md): on a 2-core Xeon
# with AMX (2026-12-04), SmolLM2-135M 40 x 160 + 40 tokens 11.01 against 4.34 s, the Qwen2.5-0.5B shape
# 16 x 128 + 32 10.10 against 3.65 s; on a 2-core Zen 4 EPYC with AVX512-BF16 and no AMX, bf16 linears on
# batchjob's own kernel (2026-12-07), 14.40 against 7.18 s, 11.61 against 6.15 s, and the 1.5B shape 8 x 128 + 32
# 23.81 against 10.76 s (on oneDNN's, 2026-12-06: 13.02 / 8.29, 11.67 / 6.74, 23.87 / 11.58). Agreement: the
# quick start's labels, 189 of 200 the same on an AVX512-BF16 EPYC (measurements/bf16_agreement.py), 187 on
# that Xeon.
FASTER_BF16 = (
    "this CPU computes bf16 natively ({kind}): --dtype bfloat16 ran {speed} float32's speed on such a CPU, "
    "with answers that differ from float32's where two tokens nearly tie (the quick start's labels: 187-189 "
    "of 200 the same); float32 stays the default (docs/performance.md)"
)
SPEED_AMX = {"kind": "AMX", "speed": "2.5-2.8x"}
SPEED_AVX512 = {"kind": "AVX512-BF16, no AMX", "speed": "1.9-2.2x"}


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX's bf16 tiles (``amx_bf16`` among /proc/cpuinfo's flags; False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def dtype_hint(device: torch.device, dtype: torch.dtype, chosen: bool) -> str | None:
    """The line for a model left at the default dtype (``chosen`` False) that resolved to float32 on a CPU
    where bf16 is native, and so much faster, by how much on such a CPU; None anywhere else."""
    if chosen or device.type != "cpu" or dtype != torch.float32 or not native_bf16():
        return None
    return FASTER_BF16.format(**(SPEED_AMX if has_amx() else SPEED_AVX512))


def warn_if_slow(device: torch.device, dtype: torch.dtype) -> None:
    """Log :func:`slow_bf16`'s line, if any (unconfigured, Python's logging prints it on stderr)."""
    line = slow_bf16(device, dtype)
    if line is not None:
        log.warning(line)
