"""An attention layer's q, k and v projections as three packed oneDNN calls against one call over their rows
packed together (``batchjob/engine/cpu/siblings.py``), every layer of a model shape, at a decode step's rows.

    python measurements/joint_qkv.py [--rows 16,64] [--threads 2] [--rounds 15]

Random weights (and biases, as Qwen2 has) at three shapes: Qwen2.5-0.5B (24 layers, q 896 x 896, k and v 128 x
896), SmolLM2-135M (30 layers, 576 and 192) and Qwen2.5-1.5B (28 layers, 1,536 and 256), bf16 where the CPU has
native bf16, and float32. One step's worth of every layer's projections is timed, the two forms alternating
round by round (each layer's weights its own, so they come from memory as in a step); the median of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = (("Qwen2.5-0.5B", 896, 128, 24), ("SmolLM2-135M", 576, 192, 30), ("Qwen2.5-1.5B", 1536, 256, 28))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,64", help="rows per call (a decode step's requests)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from batchjob.engine.cpu.bf16 import native_bf16
    from batchjob.engine.cpu.linear import _pack

    linear = torch.ops.mkldnn._linear_pointwise
    dtypes = [torch.bfloat16, torch.float32] if native_bf16() else [torch.float32]
    for name, hidden, kv, layers in SHAPES:
        for dtype in dtypes:
            apart, joint = [], []
            for _ in range(layers):
                ws = [torch.randn(n, hidden, dtype=dtype) for n in (hidden, kv, kv)]
                bs = [torch.randn(n, dtype=dtype) for n in (hidden, kv, kv)]
                apart.append([(_pack(w), b) for w, b in zip(ws, bs, strict=True)])
                joint.append((_pack(torch.cat(ws)), torch.cat(bs)))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(1, rows, hidden, dtype=dtype)

                def three(x=x, apart=apart) -> None:
                    for layer in apart:
                        for w, b in layer:
                            linear(x, w, b, "none", [], "")

                def one(x=x, joint=joint) -> None:
                    for w, b in joint:
                        linear(x, w, b, "none", [], "")

                times: dict[str, list[float]] = {"three": [], "one": []}
                three(), one()  # warm
                for _ in range(args.rounds):
                    for label, fn in (("three", three), ("one", one)):
                        t = time.perf_counter()
                        fn()
                        times[label].append(time.perf_counter() - t)
                a, b = (statistics.median(times[k]) * 1e3 for k in ("three", "one"))
                kind = str(dtype).removeprefix("torch.")
                print(
                    f"{name} {kind} {rows} rows: three calls {a:.2f} ms, one {b:.2f} ms a step ({a / b:.2f}x)"
                )


if __name__ == "__main__":
    main()
