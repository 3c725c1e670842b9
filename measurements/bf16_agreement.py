"""bf16 against float32 on the CPU: how far greedy text agrees, how often quick-start labels agree, and the
decode kernel's time in each.

    python measurements/bf16_agreement.py [--parts text,labels,kernel] [--rows 48] [--threads N]

``text``: the embedded default model (SmolLM2-135M-Instruct) in float32 and in bf16 on the first ``--rows``
rows of ``examples/bench_text.jsonl`` through its chat template, greedy, up to 128 tokens, stopping at EOS:
per row the tokens before the first difference (a row is identical when both outputs are), how many rows
are identical, the median and minimum over all rows and over the rows that differ, and each dtype's wall time and generated tokens/s (same process, one after the other).
``labels``: the quick start job (``jobs/quickstart.toml``, labels under ``choices``) run as a user runs it,
``batchjob run jobs/quickstart.toml --dtype D --output TMP``, once per dtype: the label agreement rate, and
each run's time, and how many labels each dtype gets equal to ``examples/reviews.jsonl``'s own ``label``
column. ``kernel``: the C++ decode kernel (``batchjob/engine/cpu/csrc/paged_decode.cpp``) at a
decode step's shape, 32 requests x 512 keys, 9 query / 3 KV heads of 64 (SmolLM2-135M), block 16, scattered
blocks: median milliseconds per call in float32 and in bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent


def _generate(dtype: str, rows: int) -> tuple[list[list[int]], float, int]:
    from batchjob import Engine, SamplingParams
    from batchjob.bench.workload import read_texts

    eng = Engine.from_pretrained(None, device="cpu", dtype=dtype)
    prompts = []
    for text in read_texts(HERE / "examples" / "bench_text.jsonl", rows):
        ids = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_new_tokens=128, temperature=0))]
    return outs, time.perf_counter() - start, sum(map(len, outs))


def text_agreement(rows: int) -> None:
    runs = {dtype: _generate(dtype, rows) for dtype in ("float32", "bfloat16")}
    f32, bf16 = runs["float32"][0], runs["bfloat16"][0]
    before, differ = [], []  # per row: tokens before the first difference (a whole identical row: its length)
    for a, b in zip(f32, bf16, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        before.append(first)
        if a != b:
            differ.append(first)
    identical = len(f32) - len(differ)
    print(f"text: {rows} rows of examples/bench_text.jsonl, chat template, greedy, up to 128 tokens")
    print("  tokens before the first difference, per row (* identical): ", end="")
    print(", ".join(f"{n}{'*' if a == b else ''}" for n, a, b in zip(before, f32, bf16, strict=True)))
    print(
        f"  identical rows {identical}/{rows}; over all rows (an identical row counts its length) median "
        f"{statistics.median(before)}, min {min(before)}; over the {len(differ)} rows that differ median "
        f"{statistics.median(differ) if differ else '-'}, min {min(differ, default='-')}; float32 rows' "
        f"lengths: median {statistics.median(map(len, f32))}"
    )
    for dtype, (_, wall, gen) in runs.items():
        print(f"  {dtype}: {wall:.1f} s, {gen} tokens, {gen / wall:.1f} generated tok/s")


def label_agreement() -> None:
    import pyarrow.dataset as ds

    labels, walls = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            out = Path(tmp) / dtype
            cmd = [sys.executable, "-m", "batchjob", "run", str(HERE / "jobs" / "quickstart.toml")]
            start = time.perf_counter()
            subprocess.run([*cmd, "--dtype", dtype, "--output", str(out)], check=True, capture_output=True)
            walls[dtype] = time.perf_counter() - start
            table = ds.dataset(out, format="parquet").to_table(columns=["review_id", "generated_text"])
            labels[dtype] = dict(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))
    f32, bf16 = labels["float32"], labels["bfloat16"]
    assert f32.keys() == bf16.keys()
    same = sum(f32[k] == bf16[k] for k in f32)
    differ = sorted((k, f32[k], bf16[k]) for k in f32 if f32[k] != bf16[k])
    truth = {}
    with open(HERE / "examples" / "reviews.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            truth[row["review_id"]] = row["label"]
    print(f"labels: jobs/quickstart.toml, {same}/{len(f32)} labels agree ({same / len(f32):.1%})")
    for dtype, got in labels.items():
        right = sum(got[k] == truth.get(k) for k in got)
        print(f"  {dtype}: {right}/{len(got)} equal to the reviews' own label column")
    print(f"  differing (id, float32, bf16): {differ}")
    print("  " + ", ".join(f"{d}: batchjob run {w:.1f} s" for d, w in walls.items()))


def kernel_time(repeats: int = 200) -> None:
    from batchjob.engine.cpu import kernel

    if kernel.load() is None:
        print("kernel: not available (see the log)")
        return
    gen = torch.Generator().manual_seed(0)
    seqs, ctx, heads, kv_heads, dim, block = 32, 512, 9, 3, 64, 16
    per_seq = ctx // block
    num_blocks = seqs * per_seq + 7
    table = torch.randperm(num_blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    k = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    q = torch.randn(seqs, heads, dim, generator=gen)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), table, lens, dim**-0.5, None)
        for _ in range(10):
            kernel.paged_decode(*args)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            kernel.paged_decode(*args)
            samples.append(time.perf_counter() - start)
        times[dtype] = statistics.median(samples) * 1e3
    f32, bf16 = times[torch.float32], times[torch.bfloat16]
    print(
        f"kernel: {seqs} requests x {ctx} keys, {heads}/{kv_heads} heads of {dim}, block {block}, "
        f"{torch.get_num_threads()} threads: float32 {f32:.3f} ms, bf16 {bf16:.3f} ms per call "
        f"(bf16 {f32 / bf16:.2f}x float32's speed)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="text,labels,kernel")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from batchjob.engine.cpu.bf16 import native_bf16

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16: {native_bf16()}")
    parts = args.parts.split(",")
    if "kernel" in parts:
        kernel_time()
    if "labels" in parts:
        label_agreement()
    if "text" in parts:
        text_agreement(args.rows)


if __name__ == "__main__":
    main()
