"""What the chunk grid of task rows costs: the same texts run by engines of one process that differ only in
their chunk grid (engine/tasks/policy.py: a causal row's chunks depend on the row alone; ``none``: chunks cut where
the step's budget runs out, as before the grid), alternating, fastest of ``--rounds``.

    python measurements/task_grid_ab.py MODEL_DIR --task score --grids 512,128,none --min-tokens 300 --max-tokens 1500
"""

from __future__ import annotations

import argparse
import time

import torch

from batchjob.bench.tasks import docstring_texts
from batchjob.engine.engine import Engine
from batchjob.engine.scheduler import ChunkPolicy
from batchjob.engine.tasks.policy import ChunkGrid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--task", choices=["embed", "score"], default="embed")
    ap.add_argument("--grids", default="128,none", help="chunk grids in tokens, or none")
    ap.add_argument("--texts", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engines = {}
    for grid in args.grids.split(","):
        engine = Engine.from_pretrained(args.model, task=args.task, device="cpu", dtype="float32")
        engine.scheduler.chunks = ChunkPolicy() if grid == "none" else ChunkGrid(int(grid))
        engines[grid] = engine
    first = next(iter(engines.values()))
    texts = docstring_texts(first.tokenizer, args.texts, args.min_tokens, args.max_tokens, 0)
    for engine in engines.values():
        getattr(engine, args.task)(texts[:2])  # warm-up
    best = dict.fromkeys(engines, float("inf"))
    steps = {}
    for _ in range(args.rounds):
        for grid, engine in engines.items():
            before = engine.stats.steps
            start = time.perf_counter()
            getattr(engine, args.task)(texts)
            best[grid] = min(best[grid], time.perf_counter() - start)
            steps[grid] = engine.stats.steps - before
    for grid, seconds in best.items():
        print(f"grid {grid}: {seconds:.2f} s, {steps[grid]} steps")


if __name__ == "__main__":
    main()
