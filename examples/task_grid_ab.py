"""What the chunk grid of task rows costs: the same texts embedded by two engines of one process, one with
the grid (scheduler.py: a causal row's chunks depend on the row alone) and one with it switched off (chunks
cut where the step's budget runs out), alternating, fastest of ``--rounds``.

    python examples/task_grid_ab.py MODEL_DIR --texts 48 --max-tokens 512
"""

from __future__ import annotations

import argparse
import time

import torch

from batchjob.bench.tasks import docstring_texts
from batchjob.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--texts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engines = {}
    for name in ("grid", "no grid"):
        engine = Engine.from_pretrained(args.model, task="embed", device="cpu", dtype="float32")
        if name == "no grid":
            engine.scheduler.chunk_grid = None
        engines[name] = engine
    texts = docstring_texts(engines["grid"].tokenizer, args.texts, 20, args.max_tokens, 0)
    for engine in engines.values():
        engine.embed(texts[:4])  # warm-up
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.embed(texts)
            best[name] = min(best[name], time.perf_counter() - start)
    for name, seconds in best.items():
        print(f"{name}: {seconds:.2f} s")
    print(f"grid / no grid: {best['grid'] / best['no grid']:.3f}")


if __name__ == "__main__":
    main()
