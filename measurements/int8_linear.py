"""Does int8 weight-only quantization pay on this CPU?

One transformer layer's linear weights at a model shape (q/k/v, o, gate, up, down), multiplied by M rows
of activations: our float32 path (oneDNN with the weight prepacked, ``engine/cpu/linear.py``) against
torch's own int8 weight-only kernel (``torch._weight_int8pack_mm``: per-channel int8 weights and scales,
bfloat16 activations; what torchao's int8 weight-only layout calls on a CPU). Rows per call are a decode
step's requests (1-64) or a prompt chunk (128-512). Fastest of ``--repeats`` calls each, both in one process.

    python measurements/int8_linear.py --shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from batchjob.engine.cpu.linear import _pack, _packed_forward

SHAPES = {  # hidden, intermediate, q heads * head dim, kv heads * head dim
    "qwen2.5-0.5b": (896, 4864, 896, 128),
    "qwen2.5-1.5b": (1536, 8960, 1536, 256),
}


def _int8_forward(x: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x.bfloat16(), w8, scales).float()


def fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="qwen2.5-1.5b")
    ap.add_argument("--rows", default="1,8,16,32,64,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden, inter, q, kv = SHAPES[args.shape]
    layer = []  # (packed float32 linear, int8 weight, bfloat16 scales)
    for k, n in [(hidden, q + 2 * kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]:
        lin = torch.nn.Linear(k, n, bias=False)
        lin._batchjob_packed = _pack(lin.weight)
        scale = lin.weight.abs().amax(dim=1) / 127
        w8 = torch.round(lin.weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        layer.append((lin, w8, scale.bfloat16()))
    print(f"{args.shape}: one layer's linears, {args.threads} threads, fastest of {args.repeats}")
    print("rows | float32 packed ms | int8 weights ms | float32 / int8")
    for m in (int(r) for r in args.rows.split(",")):
        f32 = i8 = 0.0
        for lin, w8, s in layer:
            x = torch.randn(m, lin.in_features)
            f32 += fastest(functools.partial(_packed_forward, lin, x), args.repeats)
            i8 += fastest(functools.partial(_int8_forward, x, w8, s), args.repeats)
        print(f"{m} | {f32 * 1e3:.2f} | {i8 * 1e3:.2f} | {f32 / i8:.2f}x", flush=True)


if __name__ == "__main__":
    main()
