"""LoRA adapters with a prefill-only task: ``score`` of the same rows as base rows and spread round-robin over
COUNT adapters of rank RANK, in one engine, alternating rounds (each figure its fastest round); and the
adapters' rows once more with the task engine's one-row products (``torch.bmm``, what keeps a row's floats
independent of its batch mates) swapped for plain GEMMs, to show what that choice costs.

    python measurements/lora_tasks_ab.py [--rows 32] [--tokens 128] [--adapters 4] [--rank 16] [--rounds 3]

Random adapters (the writer of batchjob/bench/lora.py) on all seven projections of the embedded default
model, float32 on the CPU, prefix cache off.
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
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="tokens a row")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from lora_adapters import adapters
    from transformers import AutoConfig

    from batchjob import Engine
    from batchjob.engine.tasks import adapters as task_adapters
    from batchjob.models import resolve_model

    base = resolve_model(None)
    config = AutoConfig.from_pretrained(base)
    folder = Path(tempfile.mkdtemp(prefix="lora-tasks-ab-"))
    lora = adapters(folder, args.adapters, args.rank, base, config)
    engine = Engine.from_pretrained(None, device="cpu", task="score", lora=lora, enable_prefix_caching=False)
    rng = random.Random(0)
    rows = [[rng.randrange(10, config.vocab_size) for _ in range(args.tokens)] for _ in range(args.rows)]
    spread = [f"a{i % args.adapters}" for i in range(args.rows)]
    rowwise = task_adapters.rowwise

    def plain(x, w):
        return x @ w

    runs = {
        "base rows": ([None] * args.rows, rowwise),
        f"{args.adapters} adapters r{args.rank}": (spread, rowwise),
        f"{args.adapters} adapters, plain GEMM": (spread, plain),
    }
    engine.score(rows[:2], adapters=spread[:2])  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for what, (names, product) in runs.items():
            task_adapters.rowwise = product
            t0 = time.perf_counter()
            engine.score(rows, adapters=names)
            best[what] = min(best[what], time.perf_counter() - t0)
    task_adapters.rowwise = rowwise
    tokens = args.rows * args.tokens
    for what, seconds in best.items():
        print(
            f"{what:<28} {seconds:6.2f} s  {tokens / seconds:7.1f} tok/s read  "
            f"{seconds / best['base rows']:.2f}x base"
        )


if __name__ == "__main__":
    main()
