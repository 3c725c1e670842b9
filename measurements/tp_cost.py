"""What tensor parallelism costs: memory per rank for a 70B-shape model, computed from its plan, and the
all-reduce traffic and time per layer per step, measured on this machine's CPU with gloo (2 ranks).

    python measurements/tp_cost.py            (about two minutes on 2 cores; BENCHMARKS.md has the numbers)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from batchjob import Engine, SamplingParams
from batchjob.engine.config import KVShape
from batchjob.engine.parallel.shard import bytes_per_rank, check_shardable
from batchjob.models import resolve_model

GIB = 2**30


def memory_table() -> None:
    """Llama-3-70B's shape (80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 28672, vocab 128256), bf16."""
    cfg = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shape = KVShape.from_config(cfg)
    print("70B shape, bf16: per rank")
    print("| N | split weights | whole (embeddings, head, norms) | weights per rank | KV per 1k tokens |")
    print("| --- | --- | --- | --- | --- |")
    for n in (1, 2, 4, 8):
        check_shardable(cfg, n)
        split, whole = bytes_per_rank(model, n)
        kv = 2 * shape.num_layers * (shape.num_kv_heads // n) * shape.head_dim * 2 * 1000
        print(
            f"| {n} | {split / GIB:.1f} GiB | {whole / GIB:.2f} GiB | {(split + whole) / GIB:.1f} GiB | "
            f"{kv / GIB:.3f} GiB |"
        )


def comm_cost(folder: str) -> None:
    """Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 KV heads, MLP 4864), 4 layers, float32, 2 ranks."""
    cfg = LlamaConfig(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=4,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=4096,
    )
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    opts = dict(device="cpu", dtype="float32", max_num_batched_tokens=512, num_blocks=512, block_size=16)
    params = SamplingParams(max_new_tokens=17, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(256)] for i in range(16)]
    layers = cfg.num_hidden_layers
    for tp in (1, 2):
        eng = Engine.from_pretrained(folder, tensor_parallel_size=tp, num_speculative_tokens=0, **opts)
        eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=0))  # warm up
        group = eng.runner.tensor_parallel
        # prefill: 16 prompts of 256 tokens in steps of 512 tokens; then 16 decode steps of 16 rows
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, params)
        for phase, steps in (("prefill", 8), ("decode", 16)):
            before = dict(group.stats()) if group else {}
            f0, t0 = eng.runner.forward_seconds, time.perf_counter()
            for _ in range(steps):
                eng.step()
            wall = time.perf_counter() - t0
            fwd = eng.runner.forward_seconds - f0
            line = f"TP {tp} {phase}: {steps} steps, {1000 * wall / steps:.1f} ms/step ({1000 * fwd / steps:.1f} in forward)"
            if group:
                s = group.stats()
                calls = s["all_reduce_calls"] - before["all_reduce_calls"]
                b = s["all_reduce_bytes"] - before["all_reduce_bytes"]
                sec = s["all_reduce_seconds"] - before["all_reduce_seconds"]
                per = steps * layers
                line += (
                    f"; all-reduce per layer per step: {calls / per:.0f} calls, {b / per / 1024:.0f} KiB, "
                    f"{1000 * sec / per:.2f} ms; plan broadcast {(s['broadcast_bytes'] - before['broadcast_bytes']) / steps / 1024:.1f} KiB/step"
                )
            print(line, flush=True)
        while eng.has_unfinished():
            eng.step()
        eng.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", help="where to write the small model it times (default: a temporary folder)")
    args = ap.parse_args()
    memory_table()
    with tempfile.TemporaryDirectory() as d:
        comm_cost(args.folder or d)
