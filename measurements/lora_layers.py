"""What LoRA adds to the layers themselves: every adapted projection of the embedded default model (float32,
packed linears, one thread) called on one input of 16 rows (a decode step) and of 512 rows (a prompt chunk),
with the step's rows on the base model, on one adapter and dealt over 4 adapters of rank 16 (``--rank``; the 512 rows in
runs of 64, as requests), in alternating rounds, fastest of each. No attention, norms or sampling: the
ratio is the projections' own, free of scheduling and of the step count (which drafts change).

    python measurements/lora_layers.py [--rounds 6] [--rank 16] [--clock thread]

``--clock thread`` times the thread's own CPU time (one thread does all the work), which a shared
machine's other programs disturb far less than the wall clock.

Run it from two checkouts back to back to compare commits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    import numpy as np
    import torch
    from lora_adapters import adapters
    from transformers import AutoConfig

    from batchjob import Engine
    from batchjob.models import resolve_model

    torch.set_num_threads(1)
    base = resolve_model(None)
    config = AutoConfig.from_pretrained(base)
    lora = adapters(Path(tempfile.mkdtemp(prefix="lora-layers-")), 4, args.rank, base, config)
    engine = Engine.from_pretrained(None, device="cpu", dtype="float32", lora=lora)
    step, layers = engine.runner.lora, engine.model.model.layers
    clock = time.thread_time if args.clock == "thread" else time.perf_counter

    def projections(x: torch.Tensor) -> None:
        for layer in layers:
            att, mlp = layer.self_attn, layer.mlp
            att.o_proj(att.q_proj(x)), att.k_proj(x), att.v_proj(x)
            mlp.down_proj(mlp.gate_proj(x) * mlp.up_proj(x))

    runs = {
        rows: {
            "base": np.zeros(rows, np.int64),
            "1 adapter": np.ones(rows, np.int64),
            "4 adapters": (np.arange(rows) // (1 if rows == 16 else 64) % 4 + 1).astype(np.int64),
        }
        for rows in (16, 512)
    }
    best: dict[tuple[int, str], float] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for rows, kinds in runs.items():
                x = torch.randn(1, rows, config.hidden_size)
                for kind, index in kinds.items():
                    for _ in range(6 if rows == 16 else 1):
                        step.set(index)  # a fresh step: nothing of the last one is reused
                        t0 = clock()
                        projections(x)
                        seconds = clock() - t0
                        best[rows, kind] = min(best.get((rows, kind), seconds), seconds)
    for rows, kinds in runs.items():
        b = best[rows, "base"]
        cells = "  ".join(f"{k} {best[rows, k] * 1e3:.1f} ms ({best[rows, k] / b:.2f}x)" for k in kinds)
        print(f"{rows:>3} rows: {cells}")


if __name__ == "__main__":
    main()
