"""What a repetition penalty costs a generation run (engine/penalties.py): the same requests with no penalty
and with one (Qwen2.5's 1.05), at equal work (EOS ignored, every row the same number of tokens), in one
engine, alternating rounds; drafts off in both (a penalised row does not draft).

    python measurements/penalty_cost.py [--model PATH] [--rows 32] [--new 64] [--rounds 3]

Prints each round's seconds for both, then the best of each and their ratio (penalised / plain).
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new", type=int, default=64, help="tokens generated a row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--penalty", type=float, default=1.05)
    args = parser.parse_args()
    from batchjob import Engine, SamplingParams  # (after --help: loading torch takes seconds)

    engine = Engine.from_pretrained(args.model, device="cpu", dtype="float32", num_speculative_tokens=0)
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 160))] for _ in range(args.rows)]
    plain = SamplingParams(max_new_tokens=args.new, temperature=0, ignore_eos=True, repetition_penalty=1.0)
    runs = {"plain": plain, "penalised": plain.replace(repetition_penalty=args.penalty)}
    engine.generate(prompts[:4], plain)  # warm-up
    best = {name: float("inf") for name in runs}
    for i in range(args.rounds):
        for name, params in runs.items():
            t = time.perf_counter()
            outs = engine.generate(prompts, params)
            seconds = time.perf_counter() - t
            assert sum(len(o.token_ids) for o in outs) == args.rows * args.new  # equal work
            best[name] = min(best[name], seconds)
            print(f"round {i}: {name} {seconds:.2f} s")
    print(
        f"best: plain {best['plain']:.2f} s, penalised {best['penalised']:.2f} s, "
        f"ratio {best['penalised'] / best['plain']:.3f}"
    )


if __name__ == "__main__":
    main()
