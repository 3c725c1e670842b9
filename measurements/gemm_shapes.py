"""One model's linear layers alone, bf16 or float32: our packed linears against the alternatives, at the
rows per call the engine uses (a prompt step's 512, a decode step's 16).

    python measurements/gemm_shapes.py [--shape qwen2.5-0.5b] [--rows 16,512] [--threads 1] [--dtype bfloat16]
                                       [--copies 1]

Each shape (q/o, k/v, gate/up, down, the output head) with random weights: ``packed`` (the engine's
``_reorder_linear_weight`` layout for 64 rows), ``packed-rows`` (laid out for the rows measured),
``mkldnn-plain`` (a plain ``to_mkldnn`` copy), ``F.linear`` and ``matmul`` on the plain weight; in bf16
where the CPU library has AVX512-BF16, ``kernel`` (the engine's own bf16 linear, ``csrc/linear_bf16.cpp``). The
alternatives alternate call by call, and each figure is the fastest of the rounds. ``--copies N`` cycles
through N weights of the shape, so that with enough of them (past the last-level cache) each call reads its
weight from memory, as a decode step does; GB/s is then the weight bytes read a second. With one thread the time
is the thread's CPU time, which other programs on the machine barely move (a busy shared machine halves the
wall-clock rate); with more, wall time. GFLOP/s: 2 per weight per row.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (in, out) per model shape
    "qwen2.5-0.5b": {
        "q/o": (896, 896),
        "k/v": (896, 128),
        "gate/up": (896, 4864),
        "down": (4864, 896),
        "head": (896, 151936),
    },
    "qwen2.5-1.5b": {
        "q/o": (1536, 1536),
        "k/v": (1536, 256),
        "gate/up": (1536, 8960),
        "down": (8960, 1536),
        "head": (1536, 151936),
    },
}


def _candidates(w: torch.Tensor, rows: int) -> dict:
    from batchjob.engine.cpu import kernel, linear

    lp = torch.ops.mkldnn._linear_pointwise
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    packed_rows = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    plain = w.to_mkldnn()
    wt = w.t()
    found = {
        "packed": lambda x: lp(x, packed, None, "none", [], ""),
        "packed-rows": lambda x: lp(x, packed_rows, None, "none", [], ""),
        "mkldnn-plain": lambda x: lp(x, plain, None, "none", [], ""),
        "F.linear": lambda x: F.linear(x, w),
        "matmul": lambda x: torch.matmul(x, wt),
    }
    if w.dtype == torch.bfloat16 and kernel.linear_takes():
        found["kernel"] = linear.Blocks(w, None)
    return found


def measure(k: int, n: int, rows: int, dtype: torch.dtype, rounds: int, copies: int) -> dict[str, float]:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    sets = [_candidates((torch.randn(n, k) * 0.02).to(dtype), rows) for _ in range(copies)]
    x = torch.randn(rows, k).to(dtype)
    reps = max(1, 2048 // rows // copies) if n < 100000 else 2
    best = dict.fromkeys(sets[0], float("inf"))
    for _ in range(rounds):
        for name in best:
            fns = [fns[name] for fns in sets]
            fns[0](x)
            t = clock()
            for _ in range(reps):
                for fn in fns:
                    fn(x)
            best[name] = min(best[name], (clock() - t) / reps / copies)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="16,512", help="rows per call, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=1, help="weights of each shape called in turn (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    w_bytes = torch.finfo(dtype).bits // 8
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""  # Linux
    have = [f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in flags]
    print(f"{args.shape}, {args.dtype}, {args.threads} thread(s), CPU features: {', '.join(have) or 'none'}")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES[args.shape].items():
            if name == "head" and rows > 64:
                continue  # the head runs only on the rows that sample: one per request in a prompt step
            best = measure(k, n, rows, dtype, args.rounds, 1 if name == "head" else args.copies)
            fastest = min(best, key=best.__getitem__)
            size = k * n * w_bytes
            cells = " ".join(
                f"{c}={t * 1e3:.3f}ms/{2 * rows * k * n / t / 1e9:.0f}GF/{size / t / 1e9:.1f}GB/s"
                for c, t in best.items()
            )
            print(f"rows={rows:4d} {name:8s} {k}->{n}: {cells}  fastest: {fastest}", flush=True)


if __name__ == "__main__":
    main()
