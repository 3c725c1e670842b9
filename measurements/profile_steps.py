"""Where our engine's time goes, step by step, on the bench's synthetic workload (our engine only).

    python measurements/profile_steps.py [--seed 0] [--num-speculative-tokens 4] [--max-num-batched-tokens 512]
                                     [--dataset FILE --num-requests N]

Prints the wall time, the number of forwards, the time inside the attention hook, and per kind of step
(decode-only or mixed with prompt chunks, by size) the steps, tokens, seconds and milliseconds per token.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from transformers import AttentionInterface

import batchjob.engine.attention as attention
from batchjob import Engine, SamplingParams
from batchjob.bench.workload import dataset_workload, synthetic_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dataset", type=Path, help="prompts from this JSONL/Parquet file (as batchjob bench)")
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()

    attn_seconds = [0.0]

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return attention.paged_attention(*a, **k)
        finally:
            attn_seconds[0] += time.perf_counter() - t

    AttentionInterface.register(attention.ATTN_NAME, timed)
    kw = {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.num_speculative_tokens is not None:
        kw["num_speculative_tokens"] = args.num_speculative_tokens
    engine = Engine.from_pretrained(None, device="cpu", **kw)
    if args.dataset is not None:
        work = dataset_workload(args.dataset, engine.tokenizer, args.num_requests, (8, 100), args.seed, 1900)
    else:
        work = synthetic_workload(engine.vocab_size, args.num_requests, (24, 600), (8, 100), args.seed)
    print(work.describe())
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up
    attn_seconds[0] = 0.0
    for i, (prompt, n) in enumerate(zip(work.prompts, work.max_new_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=n))

    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    steps0, drafts0, kept0 = engine.stats.steps, engine.stats.draft_tokens, engine.stats.accepted_draft_tokens
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens_before, attn_before = engine.stats.batched_tokens, attn_seconds[0]
        prompt_before = engine.stats.computed_prompt_tokens
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        tokens = engine.stats.batched_tokens - tokens_before
        kind = "mixed" if engine.stats.computed_prompt_tokens > prompt_before else "decode-only"
        kind += " <=16" if tokens <= 16 else " <=64" if tokens <= 64 else " >64"
        row = kinds[kind]
        row[0] += 1
        row[1] += tokens
        row[2] += dt
        row[3] += attn_seconds[0] - attn_before
    wall = time.perf_counter() - start
    s = engine.stats
    print(
        f"wall {wall:.1f} s, {s.steps - steps0} forwards, {work.output_tokens / wall:.1f} output tok/s, "
        f"attention {attn_seconds[0]:.1f} s, drafts kept {s.accepted_draft_tokens - kept0} of "
        f"{s.draft_tokens - drafts0}"
    )
    for kind, (n, tokens, secs, attn) in sorted(kinds.items()):
        print(
            f"  {kind:17s} steps {int(n):4d}  tokens {int(tokens):6d}  {secs:6.1f} s (attention {attn:4.1f} s)  "
            f"{1000 * secs / n:6.0f} ms/step  {1000 * secs / max(tokens, 1):6.2f} ms/token"
        )


if __name__ == "__main__":
    main()
