"""LoRA adapters per row against the base model, in one process: one engine holding every adapter runs
the same 16 requests (64 random prompt tokens, 32 output tokens, greedy) with base rows and with rows spread
round-robin over COUNT adapters of rank RANK, in alternating rounds; each figure is its fastest round, so
the ratios are measured under the same load.

    python measurements/lora_ab.py [--grid 1x16,4x16,16x16] [--rounds 2] [--clock thread]

Random adapters (the writer of batchjob/bench/lora.py) on all seven projections of the embedded
default model, float32 on the CPU. Run it from two checkouts back to back to compare commits. ``--clock
thread`` times the main thread's CPU time (with ``OMP_NUM_THREADS=1`` it does all the work), which other
programs on a shared machine disturb far less than the wall clock.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", default="1x16,4x16,16x16", help="COUNTxRANK,... of the adapter runs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    from lora_adapters import adapters
    from transformers import AutoConfig

    from batchjob import Engine, SamplingParams
    from batchjob.models import resolve_model

    base = resolve_model(None)
    config = AutoConfig.from_pretrained(base)
    folder = Path(tempfile.mkdtemp(prefix="lora-ab-"))
    cells = [tuple(map(int, c.split("x"))) for c in args.grid.split(",")]
    lora = {}
    for count, rank in cells:
        for name, path in adapters(folder, count, rank, base, config).items():
            lora[f"r{rank}{name}"] = path
    engine = Engine.from_pretrained(None, device="cpu", lora=lora)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, config.vocab_size) for _ in range(64)] for _ in range(16)]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    runs: dict[str, list[str | None]] = {"base": [None] * 16}
    for count, rank in cells:
        runs[f"{count} adapters rank {rank}"] = [f"r{rank}a{i % count}" for i in range(16)]
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for what, names in runs.items():
            engine.reset_prefix_cache()
            t0 = clock()
            engine.generate(prompts, params, adapters=names)
            best[what] = min(best[what], clock() - t0)
    for what, seconds in best.items():
        print(
            f"{what:<24} {seconds:6.2f} s  {16 * 32 / seconds:6.1f} tok/s  {seconds / best['base']:.2f}x base"
        )


if __name__ == "__main__":
    main()
