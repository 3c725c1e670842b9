"""Ours, llama.cpp and transformers' continuous batching on one workload, each in its own process, with the
memory each one holds: one row of BENCHMARKS.md's table of sizes.

    python measurements/sizes_table.py [--model DIR] [--dtype float32] [--num-requests 16] [--prompt-len 128]
                                   [--output-len 32] [--engines ours,llama.cpp,hf-cb] [--threads 2]

Each engine loads only its own model in a fresh process, so its peak RSS (the kernel's high-water mark of
that process: weights, any packed copies, KV cache, working memory) is its alone. llama.cpp runs as the
bench runs it (``batchjob bench --baselines llama.cpp``: llama-batched-bench at this equal shape, and
llama-server); its figure is the faster of the two, its RSS that program's own. transformers CB runs with
a cache sized for the whole workload (its best budget of those given). Every engine: greedy, EOS ignored,
the same random token-id prompts (seed 0), the same threads, drafts off for ours. The KV column is what each
holds for its cache: ours the blocks its run wrote (the CPU pool takes memory as a block is first written,
under a 2 GiB budget by default), llama.cpp its context (every slot room for the longest request),
transformers the blocks given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _peak_rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _workload(args, vocab_size: int):
    from batchjob.bench.workload import synthetic_workload

    lens = (args.prompt_len, args.prompt_len), (args.output_len, args.output_len)
    return synthetic_workload(vocab_size, args.num_requests, *lens, seed=0)


def child(args) -> dict:
    """One engine, in this process: its figures as a dict (printed as JSON for the parent)."""
    import torch

    torch.set_num_threads(args.threads)
    from batchjob.bench import engines

    with torch.inference_mode():
        if args.one == "ours":
            from batchjob import Engine

            engine = Engine.from_pretrained(
                args.model, device="cpu", dtype=args.dtype, num_speculative_tokens=0
            )
            work = _workload(args, engine.vocab_size)
            r = engines.run_ours(engine, work, engine.vocab_size)
            kv = r.extra["kv_mib"]
        else:
            from transformers import AutoModelForCausalLM

            from batchjob.engine.kv_cache import KVShape

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
            vocab = model.get_input_embeddings().weight.shape[0]
            work = _workload(args, vocab)
            blocks = engines.workload_num_blocks(work)
            tries = [engines.run_hf_cb(model, work, b, vocab, blocks) for b in args.hf_cb_budgets]
            r = min((t for t in tries if not t.error), key=lambda t: t.wall_s, default=tries[0])
            per_token = KVShape.from_config(model.config).bytes_per_block(1, model.dtype)
            kv = blocks * engines.HF_CB_PAGE_SIZE * per_token / 2**20
    return {
        "engine": r.label,
        "wall_s": r.wall_s,
        "out_tps": r.output_tps,
        "error": r.error,
        "peak_rss_mib": _peak_rss_mib(),
        "kv_mib": kv,
        "outputs": r.outputs,
    }


def llama_cpp_rows(args, model_dir: Path, vocab_size: int, kv_token_bytes: int) -> list[dict]:
    from batchjob.bench import llama_cpp

    bins = llama_cpp.bin_dir()
    if bins is None:
        print(llama_cpp.BUILD_HINT, file=sys.stderr)
        return []
    gguf = llama_cpp.convert(model_dir, args.dtype, bins, lambda m: print(m, file=sys.stderr))
    work = _workload(args, vocab_size)
    rows = []
    runs = [
        lambda: llama_cpp.run_batched_bench(bins, gguf, work, args.dtype, args.threads, kv_token_bytes),
        lambda: llama_cpp.run_server(
            bins, gguf, work, args.dtype, args.threads, len(work.prompts), kv_token_bytes
        ),
    ]
    for run in runs:
        r = run()
        rows.append(
            {
                "engine": r.label,
                "wall_s": r.wall_s,
                "out_tps": r.output_tps,
                "error": r.error,
                "peak_rss_mib": r.extra.get("peak_rss_mib"),
                "kv_mib": r.extra.get("kv_mib"),
                "outputs": r.outputs,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="ours,llama.cpp,hf-cb")
    ap.add_argument("--hf-cb-budgets", default="256,512", help="transformers CB token budgets (best kept)")
    ap.add_argument("--one", choices=("ours", "hf-cb"), help=argparse.SUPPRESS)  # the child's engine
    args = ap.parse_args()
    args.hf_cb_budgets = [int(b) for b in args.hf_cb_budgets.split(",")]

    from batchjob.models import resolve_model

    args.model = resolve_model(args.model)
    if args.one:
        print(json.dumps(child(args)))
        return

    from transformers import AutoConfig

    from batchjob.engine.kv_cache import KVShape

    config = AutoConfig.from_pretrained(args.model)
    import torch

    per_token = KVShape.from_config(config).bytes_per_block(1, getattr(torch, args.dtype))
    rows: list[dict] = []
    for name in args.engines.split(","):
        start = time.perf_counter()
        if name == "llama.cpp":
            rows += llama_cpp_rows(args, Path(args.model), config.vocab_size, per_token)
        else:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                rows.append({"engine": name, "error": f"exit {done.returncode}"})
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)

    ours = next((r for r in rows if r["engine"].startswith("ours") and not r.get("error")), None)
    print(
        f"model {Path(args.model).name}, {args.dtype}, {args.num_requests} x {args.prompt_len} + "
        f"{args.output_len}, {args.threads} threads"
    )
    print("| engine | wall s | out tok/s | ours / it | peak RSS MiB | KV MiB | greedy == ours |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("error"):
            print(f"| {r['engine']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{ours['out_tps'] / r['out_tps']:.2f}x" if ours and r["out_tps"] else ""
        same = ""
        if ours and r["outputs"] and r is not ours:
            same = f"{sum(a == b for a, b in zip(ours['outputs'], r['outputs'], strict=True))}/{len(r['outputs'])}"
        rss = f"{r['peak_rss_mib']:,.0f}" if r.get("peak_rss_mib") else "?"
        kv = f"{r['kv_mib']:,.0f}" if r.get("kv_mib") is not None else "?"
        print(f"| {r['engine']} | {r['wall_s']:.2f} | {r['out_tps']:.1f} | {ratio} | {rss} | {kv} | {same} |")


if __name__ == "__main__":
    main()
