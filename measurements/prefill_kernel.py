"""The prompt-chunk attention kernels (``engine/cpu/csrc/``: bf16's ``paged_prefill.cpp``, float32's
``prefill_f32.cpp``, chosen by ``--dtype``) against torch's SDPA per
chunk, the path it replaces: single calls at three models' head shapes, then whole runs in one engine with the
two paths alternating round by round (``BATCHJOB_CPU_PREFILL`` read at load; here the backend's switch is
flipped between rounds, so both see the same weights, cache and machine load). Before the runs, the same
kernel attending both ways over each sequence's own keys (``dense_prefill``: an encoder's rows, a vision
tower's images) against SDPA over the batch of sequences, at four encoder and tower shapes.

    python measurements/prefill_kernel.py --model /tmp/q05 [--dtype float32] [--rounds 2] [--threads 2]
                                          [--calls-only]

bf16 needs a CPU with AVX512-BF16. Runs: the bench's mixed workload (64 requests, prompts of 24-600 tokens,
8-100 output tokens, seed 0) and 16 prompts of 128 + 32 tokens; greedy, EOS ignored, drafts and the prefix
cache off. Prints each round's wall time and the attention hook's share, the ratio SDPA / kernel, and how
many greedy outputs of the two paths agree (each path rounds differently: a near-tie can flip).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import batchjob.engine.attention as attention
from batchjob import Engine, SamplingParams
from batchjob.bench.workload import synthetic_workload
from batchjob.engine.cpu import kernel

HEAD_SHAPES = {"Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-1.5B": (12, 2, 128), "SmolLM2-135M": (9, 3, 64)}


def _best_ms(fn, *args, repeat: int = 5, **kwargs) -> float:
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def single_calls(dtype: torch.dtype) -> None:
    print(f"one prompt of L tokens, {dtype}, causal (GFLOP/s counts the causal half):")
    for name, (heads, kv_heads, dim) in HEAD_SHAPES.items():
        for length in (128, 600, 2048):
            blocks = -(-length // 16)
            k_cache = torch.randn(blocks, 16, kv_heads, dim).to(dtype)
            v_cache = torch.randn(blocks, 16, kv_heads, dim).to(dtype)
            q = torch.randn(heads, length, dim).to(dtype)
            out = torch.empty(length, heads, dim, dtype=dtype)
            n = torch.tensor([length])
            table, first = torch.arange(blocks)[None], torch.tensor([0])
            ours = _best_ms(kernel.paged_prefill, q, k_cache, v_cache, table, first, n, n, dim**-0.5, out)
            k = k_cache.view(-1, kv_heads, dim).transpose(0, 1)[None]
            v = v_cache.view(-1, kv_heads, dim).transpose(0, 1)[None]
            sdpa = _best_ms(F.scaled_dot_product_attention, q[None], k, v, is_causal=True, enable_gqa=True)
            flops = 2 * heads * length * length * dim
            print(
                f"  {name:13s} L={length:5d}: kernel {ours:7.2f} ms ({flops / ours / 1e6:4.0f} GFLOP/s), "
                f"SDPA {sdpa:7.2f} ms ({flops / sdpa / 1e6:4.0f}), {sdpa / ours:.2f}x"
            )


# (sequences, tokens each, heads, head size): a tower call of 8 CLIP B/16 images, 2 SigLIP crops of 512 px,
# MiniLM's rows of the bench's mean length and of its longest
BOTH_WAYS_SHAPES = {
    "CLIP ViT-B/16, 8 images": (8, 197, 12, 64),
    "SigLIP-B/16-512, 2 crops": (2, 1024, 12, 64),
    "MiniLM-L6, 16 rows": (16, 148, 12, 32),
    "MiniLM-L6, 4 rows of 512": (4, 512, 12, 32),
}


def both_ways_calls(dtype: torch.dtype) -> None:
    print(
        f"sequences attended both ways over their own keys, {dtype} (q, k, v: column views of one projection):"
    )
    for name, (batch, length, heads, dim) in BOTH_WAYS_SHAPES.items():
        qkv = torch.randn(batch * length, 3 * heads * dim).to(dtype)
        q, k, v = (
            qkv[:, i * heads * dim : (i + 1) * heads * dim].view(batch * length, heads, dim) for i in range(3)
        )
        flat = [x.transpose(0, 1) for x in (q, k, v)]  # [H, B * T, D]
        starts, lens = torch.arange(batch) * length, torch.full((batch,), length)
        out = torch.empty(batch * length, heads, dim, dtype=dtype)
        ours = _best_ms(kernel.dense_prefill, *flat, starts, lens, dim**-0.5, False, out)
        q4, k4, v4 = (x.view(batch, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        sdpa = _best_ms(F.scaled_dot_product_attention, q4, k4, v4)
        flops = 4 * batch * heads * length * length * dim
        print(
            f"  {name:25s}: kernel {ours:7.2f} ms ({flops / ours / 1e6:4.0f} GFLOP/s), "
            f"SDPA {sdpa:7.2f} ms ({flops / sdpa / 1e6:4.0f}), {sdpa / ours:.2f}x"
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def whole_runs(model: str, rounds: int, dtype: torch.dtype) -> None:
    engine = Engine.from_pretrained(
        model, device="cpu", dtype=dtype, num_speculative_tokens=0, enable_prefix_caching=False
    )
    backend = engine.runner.attention
    assert backend.name == "cpu_kernel" and backend.prefill_kernel, "the prefill kernel does not run here"
    hook_seconds = [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return attention.paged_attention(*args, **kwargs)
        finally:
            hook_seconds[0] += time.perf_counter() - start

    AttentionInterface.register(attention.ATTN_NAME, timed)
    workloads = {
        "mixed 64 x 24-600 + 8-100": synthetic_workload(engine.vocab_size, 64, (24, 600), (8, 100), seed=0),
        "16 x 128 + 32": synthetic_workload(engine.vocab_size, 16, (128, 128), (32, 32), seed=0),
    }
    engine.generate([[5] * 40], SamplingParams(max_new_tokens=2))  # warm-up: builds the kernels
    for name, work in workloads.items():
        walls: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[list[int]]] = {}
        for _ in range(rounds):
            for use_kernel in (True, False):
                backend.prefill_kernel = use_kernel
                hook_seconds[0] = 0.0
                params = [
                    SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=n)
                    for n in work.max_new_tokens
                ]
                start = time.perf_counter()
                outputs = engine.generate(work.prompts, params)
                wall = time.perf_counter() - start
                tokens[use_kernel] = [o.token_ids for o in outputs]
                walls[use_kernel].append(wall)
                label = "kernel" if use_kernel else "SDPA  "
                print(
                    f"  {name}: {label} {wall:6.2f} s (attention hook {hook_seconds[0]:5.2f} s)", flush=True
                )
        same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
        before = sum(_common_prefix(a, b) for a, b in zip(tokens[True], tokens[False], strict=True))
        total = sum(len(b) for b in tokens[False])
        print(
            f"{name}: greedy tokens equal on {same}/{len(work.prompts)} requests; {before}/{total} tokens agree "
            "before a request's first difference"
        )
        best_kernel, best_sdpa = min(walls[True]), min(walls[False])
        print(
            f"{name}: best SDPA / best kernel = {best_sdpa:.2f} / {best_kernel:.2f} s = {best_sdpa / best_kernel:.3f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", required=True, help="a causal LM folder (e.g. from measurements/gpu/random_model.py)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--calls-only", action="store_true", help="single calls only, no whole runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not kernel.prefill_takes(dtype, 64):
        raise SystemExit(
            f"no {args.dtype} prefill kernel here (bf16 needs AVX512-BF16: avx512_bf16 in /proc/cpuinfo)"
        )
    single_calls(dtype)
    both_ways_calls(dtype)
    if not args.calls_only:
        whole_runs(args.model, args.rounds, dtype)


if __name__ == "__main__":
    main()
