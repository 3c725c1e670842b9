"""The engine's own time a step, where the model is almost free: a tiny random Llama (tests/tiny_models.py)
whose forward takes about a millisecond, so the per-step Python of the scheduler, the features and the
runner is most of what is timed. Each checkout runs in a fresh process, alternating, ROUNDS times.

    python measurements/step_overhead.py CHECKOUT [CHECKOUT ...] [--rounds 2]

Prints, per run: the checkout, steps per generate call, and the best of three calls in milliseconds a step
(64 requests of 32 prompt + 64 output tokens, greedy, drafts off, float32, 2 threads).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import random, sys, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(2)
from batchjob import Engine, SamplingParams
eng = Engine.from_pretrained(sys.argv[2], device="cpu", dtype="float32", num_speculative_tokens=0)
rng = random.Random(0)
prompts = [[rng.randrange(3, 200) for _ in range(32)] for _ in range(64)]
params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
eng.generate(prompts[:4], params)
best, steps = 1e9, 0
for _ in range(3):
    s0, t = eng.stats.steps, time.perf_counter()
    eng.generate(prompts, params)
    steps = eng.stats.steps - s0
    best = min(best, (time.perf_counter() - t) / steps)
print(f"{sys.argv[1]}: {steps} steps, best {best * 1000:.2f} ms a step")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", help="repository checkouts to compare")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import make_model

    model = make_model(Path(tempfile.mkdtemp()) / "llama", "llama")
    for _ in range(args.rounds):
        for code in args.checkouts:
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(Path(code).resolve()), str(model)],
                capture_output=True, text=True, check=True,
            )
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
