"""Compiled CPU kernels (attention, a bf16 linear layer), built on first use with the C++ compiler.

Decoding on the CPU is bound by memory traffic: every step reads each running request's whole K/V once
per layer. The torch reference gathers a request's blocks into a contiguous copy and then runs SDPA over it,
which reads the cache, writes the copy and reads it again. The kernel in ``csrc/paged_decode.cpp`` reads
the keys and values in place through the block table, every query head of a request in one pass.

Prompt chunks in bfloat16, on a CPU with AVX512-BF16: ``csrc/paged_prefill.cpp`` computes both products of
attention as bfloat16 pairs with float sums (vdpbf16ps), where torch's CPU flash attention widens to float
and runs float GEMMs (:func:`paged_prefill`; built only where the compiler targets those instructions); in
float32 ``csrc/prefill_f32.cpp`` takes the same calls on float multiply-adds, on every CPU (GCC's vector types:
AVX-512 or AVX2 on x86). The same kernels attend rows both ways over their own keys (:func:`dense_prefill`): an encoder's
rows, a vision tower's images.

A layer's small per-row work (``csrc/rows.cpp``): the new keys and values written into the paged cache, and
the RMS norm of transformers' Llama layout, one call each where torch dispatches several ops (:mod:`.rows`).

Linear layers in bfloat16 on a CPU with AVX512-BF16 and no AMX: ``csrc/linear_bf16.cpp`` multiplies rows by a
weight packed once in its own layout (:func:`pack_bf16`, :func:`linear_bf16`), streaming the weights faster
than oneDNN's kernel does at a decode step's few rows (:mod:`.linear` chooses it).

It is plain C++ with OpenMP (no torch headers), so it compiles in about a second and is loaded with
``ctypes``. The shared library is cached under ``<cache>/kernels/`` by a digest of the source, the compiler,
the flags and the CPU (``-march=native`` code must not run on another machine sharing the cache). When no
compiler is found or the build fails, the engine keeps the torch reference and says so once in the log.
``BATCHJOB_CPU_KERNEL=0`` turns the kernel off.

OpenMP: the library links ``libgomp.so.1``; torch's own copy of it is already loaded under that name, so the
kernel runs on torch's thread pool and follows ``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from batchjob import env
from batchjob.models import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    CSRC / "paged_decode.cpp",
    CSRC / "paged_prefill.cpp",
    CSRC / "prefill_f32.cpp",
    CSRC / "linear_bf16.cpp",
    CSRC / "rows.cpp",
)  # compiled; with cpu_math.h, which they share
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DISABLE_ENV = "BATCHJOB_CPU_KERNEL"
PREFILL_ENV = "BATCHJOB_CPU_PREFILL"  # 0: prompt chunks go to torch's SDPA, as on a CPU without AVX512-BF16
LINEAR_ENV = "BATCHJOB_CPU_LINEAR"  # 0: bf16 linear layers on oneDNN's kernel, as on a CPU with AMX
# bfloat16 goes to the kernel as its 16 bits (pointers only): widened to float on load, scores, softmax and
# sums in float, the output rounded to the nearest even bfloat16.
_SYMBOLS = {
    torch.float32: "batchjob_paged_decode_f32",
    torch.float64: "batchjob_paged_decode_f64",
    torch.bfloat16: "batchjob_paged_decode_bf16",
}
DTYPES = tuple(_SYMBOLS)
_PREFILL = {torch.bfloat16: "batchjob_prefill_bf16", torch.float32: "batchjob_prefill_f32"}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _cpu_signature() -> str:
    """The CPU model and feature flags (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError:
        text = ""
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or f"{platform.machine()} {platform.processor()}"


def _build(cxx: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several workers may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (logged once) when it is turned off or can't be built."""
    if not env.flag(DISABLE_ENV):  # on unless turned off
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: CPU decode attention uses the slower torch reference")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        digest = hashlib.sha256()
        for part in (
            *(path.read_bytes() for path in sorted(CSRC.iterdir())),
            version.encode(),
            " ".join(FLAGS).encode(),
            " ".join(path.name for path in SOURCES).encode(),  # which of them are compiled
            _cpu_signature().encode(),
        ):
            digest.update(part)
            digest.update(b"\0")
        target = cache_dir() / "kernels" / f"paged_attention-{digest.hexdigest()[:16]}.so"
        if not target.is_file():
            _build(cxx, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU decode attention kernel unavailable, using the torch reference: %s", e)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the library's functions, for ``ctypes``."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _SYMBOLS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_double, i64, ptr]
        fn.restype = None
    for name in _PREFILL.values():
        fn = getattr(lib, name)
        # q, k, v (each a pointer, its head and token strides); block table, its stride, block size;
        # q_starts, q_lens, ctx_lens, chunks; heads, KV heads, head size; scale, causal, window, key_ends; out
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64]
        fn.argtypes += [i64, i64, ctypes.c_double, i64, i64, ptr, ptr]
        fn.restype = ctypes.c_int
    lib.batchjob_paged_prefill_available.restype = ctypes.c_int
    lib.batchjob_linear_bf16_available.restype = ctypes.c_int
    lib.batchjob_packed_bf16_size.argtypes = [i64, i64]
    lib.batchjob_packed_bf16_size.restype = i64
    lib.batchjob_pack_bf16.argtypes = [ptr, i64, i64, ptr]
    lib.batchjob_pack_bf16.restype = None
    lib.batchjob_linear_bf16.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]  # x, m, k, weight, bias, n, y
    lib.batchjob_linear_bf16.restype = ctypes.c_int
    # key, its head and token strides, value, its strides, slots, tokens, KV heads, head size, bytes, caches
    lib.batchjob_write_kv.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr]
    lib.batchjob_write_kv.restype = None
    for name in (
        "batchjob_rms_norm_f32",
        "batchjob_rms_norm_bf16",
    ):  # x, rows, n, row stride, w, eps, lanes, y
        getattr(lib, name).argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, i64, ptr]
        getattr(lib, name).restype = None


def prefill_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`paged_prefill` runs here for this dtype and head size (and is not turned off): float32
    wherever the library builds, bfloat16 where the CPU has AVX512-BF16."""
    if dtype not in _PREFILL or head_dim % 16 or head_dim > 512 or not env.flag(PREFILL_ENV):
        return False
    lib = load()
    if lib is None:
        return False
    return dtype == torch.float32 or bool(lib.batchjob_paged_prefill_available())


def linear_takes() -> bool:
    """Whether :func:`linear_bf16` runs here: the library built with AVX512-BF16 (and it is not turned off)."""
    if not env.flag(LINEAR_ENV):
        return False
    lib = load()
    return lib is not None and bool(lib.batchjob_linear_bf16_available())


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [n, k] (k even) in the layout :func:`linear_bf16` reads, a new flat tensor."""
    lib = load()
    assert (
        lib is not None and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0
    )
    n, k = weight.shape
    weight = weight.contiguous()
    out = torch.empty(lib.batchjob_packed_bf16_size(n, k), dtype=torch.bfloat16)
    lib.batchjob_pack_bf16(weight.data_ptr(), n, k, out.data_ptr())
    return out


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ W.T + bias`` for bf16 rows ``x`` [..., k] and W packed by :func:`pack_bf16` (bias float32 [n])."""
    lib = load()
    assert lib is not None and x.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.float32)
    k = x.shape[-1]
    assert packed.numel() == (n + 31) // 32 * 32 * k, "x's width is not the packed weight's"
    if not x.is_contiguous():  # a check, not a torch op: a decode step makes ~150 of these calls
        x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    bias_ptr = None if bias is None else bias.data_ptr()
    status = lib.batchjob_linear_bf16(
        x.data_ptr(), x.numel() // k, k, packed.data_ptr(), bias_ptr, n, out.data_ptr()
    )
    assert status == 0, "the bf16 linear kernel called where it was built without AVX512-BF16"
    return out


def paged_decode(
    q: torch.Tensor,  # [G, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [G, max_blocks] int64
    ctx_lens: torch.Tensor,  # [G] int64
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of one query token per request over its cached keys; returns [G, H, D]."""
    lib = load()
    assert lib is not None, "paged_decode called without the kernel; check load() first"
    q, block_table, ctx_lens = (
        t if t.is_contiguous() else t.contiguous() for t in (q, block_table, ctx_lens)
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
    assert block_table.dtype == torch.int64 and ctx_lens.dtype == torch.int64
    g, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    getattr(lib, _SYMBOLS[q.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],
        ctx_lens.data_ptr(),
        g,
        heads,
        kv_heads,
        dim,
        block_size,
        float(scale),
        int(window) if window else 0,
        out.data_ptr(),
    )
    return out


def paged_prefill(
    q: torch.Tensor,  # [H, T, D] bfloat16 or float32, the step's queries (any strides with D contiguous)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], the chunks' new keys already written
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [C, max_blocks] int64: each chunk's request's blocks
    q_starts: torch.Tensor,  # [C] int64: first row of each chunk in the step
    q_lens: torch.Tensor,  # [C] int64
    ctx_lens: torch.Tensor,  # [C] int64: keys each chunk's last query sees (its new ones included)
    scale: float,
    out: torch.Tensor,  # [T, H, D]: the chunks' rows are written, the others left as they are
    window: int | None = None,  # keys a query sees, itself included; None: all
    key_ends: torch.Tensor | None = None,  # [T] int64: past the last key each row sees; None: itself
) -> None:
    """Causal attention of prompt chunks over their requests' cached keys, or up to each row's ``key_ends``
    (check :func:`prefill_takes`)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    block_size = k_cache.shape[1]
    k, v = k_cache.flatten(0, 1).transpose(0, 1), v_cache.flatten(0, 1).transpose(0, 1)  # [KVH, slots, D]
    table = block_table.contiguous()
    _prefill(q, k, v, table, block_size, q_starts, q_lens, ctx_lens, scale, True, out, window, key_ends)


def dense_prefill(
    q: torch.Tensor,  # [H, T, D] bfloat16 or float32 (any strides with D contiguous)
    k: torch.Tensor,  # [KVH, T, D]: the same rows' keys
    v: torch.Tensor,
    q_starts: torch.Tensor,  # [C] int64: first row of each sequence
    q_lens: torch.Tensor,  # [C] int64: its rows
    scale: float,
    causal: bool,
    out: torch.Tensor,  # [T, H, D]: the sequences' rows are written
    window: int | None = None,  # keys closer than this on either side (causal: before); None: all
) -> None:
    """Attention of each sequence of rows over its own keys, both ways unless ``causal`` (an encoder's
    rows, a vision tower's images; check :func:`prefill_takes`)."""
    _prefill(q, k, v, None, 1, q_starts, q_lens, q_lens, scale, causal, out, window)


def _prefill(
    q,
    k,
    v,
    block_table,
    block_size,
    q_starts,
    q_lens,
    ctx_lens,
    scale,
    causal,
    out,
    window=None,
    key_ends=None,
) -> None:
    lib = load()
    assert lib is not None and q.dtype == k.dtype == v.dtype == out.dtype and out.is_contiguous()
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    q_starts, q_lens, ctx_lens = q_starts.contiguous(), q_lens.contiguous(), ctx_lens.contiguous()
    if key_ends is not None:
        key_ends = key_ends.contiguous()
        assert key_ends.dtype == torch.int64 and key_ends.numel() == out.shape[0]
    heads, _, dim = q.shape
    status = getattr(lib, _PREFILL[q.dtype])(
        *(x for t in (q, k, v) for x in (t.data_ptr(), t.stride(0), t.stride(1))),
        0 if block_table is None else block_table.data_ptr(),
        0 if block_table is None else block_table.shape[1],
        block_size,
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        ctx_lens.data_ptr(),
        q_starts.shape[0],
        heads,
        k.shape[0],
        dim,
        float(scale),
        int(causal),
        window or 0,
        0 if key_ends is None else key_ends.data_ptr(),
        out.data_ptr(),
    )
    assert status == 0, "the prefill kernel called where it was built without AVX512-BF16"
