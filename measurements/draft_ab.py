"""Prompt-lookup drafting on, auto and off, side by side in one run, on the embedded model (CPU).

    git archive BASE --prefix=before/ | tar -x -C /tmp      # a checkout whose drafting is always on
    python measurements/draft_ab.py --before /tmp/before [--rounds 2] [--workloads text,bench]

Configurations, in rounds (on, auto, off, on, ...), each run in a fresh process with one warm-up:
``on``: the ``--before`` checkout with 4 drafts (drafting whenever the context matched, slow start);
``auto``: this checkout with 4 drafts (drafting where it pays, speculative.py); ``off``: this checkout, 0.
Workloads: ``text``, the first 48 rows of ``examples/bench_text.jsonl`` (summaries of this repository's
docs) through the model's chat template, greedy, up to 128 tokens, stopping at EOS; ``bench``, the
bench's default synthetic workload (64 requests, prompts 24-600 tokens, 8-100 out, EOS ignored, seed 0).
Prints per run the wall seconds, generated tokens/s, steps, drafts verified and kept, and a digest of the
outputs (the same in every configuration when drafts change no token), then each one's best of the rounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CHILD = r"""
import hashlib, json, sys, time
if {before!r}:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    sys.path.insert(0, {before!r})
from batchjob import Engine, SamplingParams
from batchjob.bench.workload import read_texts, synthetic_workload
from pathlib import Path

eng = Engine.from_pretrained(device="cpu", num_speculative_tokens={k})
if {workload!r} == "text":
    texts = read_texts(Path({text!r}), 48)
    prompts = []
    for t in texts:
        ids = eng.tokenizer.apply_chat_template([{{"role": "user", "content": t}}], add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    params = [SamplingParams(max_new_tokens=128, temperature=0) for _ in prompts]
else:
    work = synthetic_workload(eng.vocab_size, 64, (24, 600), (8, 100), 0)
    prompts = work.prompts
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in work.max_new_tokens]
eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up
s0 = eng.stats.steps
d0, a0, g0 = eng.stats.draft_tokens, eng.stats.accepted_draft_tokens, eng.stats.generated_tokens
t = time.perf_counter()
for i, (p, sp) in enumerate(zip(prompts, params)):
    eng.add_request(str(i), p, sp)
outs = {{}}
while eng.has_unfinished():
    for o in eng.step():
        outs[o.request_id] = o.token_ids
wall = time.perf_counter() - t
digest = hashlib.sha256(json.dumps([outs[str(i)] for i in range(len(prompts))]).encode()).hexdigest()[:12]
gen = eng.stats.generated_tokens - g0
print(json.dumps(dict(wall=wall, tok_s=gen / wall, generated=gen, steps=eng.stats.steps - s0,
                      drafts=eng.stats.draft_tokens - d0, kept=eng.stats.accepted_draft_tokens - a0,
                      digest=digest, fit=[round(c, 2) for c in eng.drafter.cost.coefficients()]
                      if hasattr(eng, "drafter") else None)))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="checkout whose drafting is always on")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="text,bench")
    args = ap.parse_args()
    configs = {"on": (str(args.before.resolve()), 4), "auto": ("", 4), "off": ("", 0)}
    text = str(HERE / "examples" / "bench_text.jsonl")
    for workload in args.workloads.split(","):
        best: dict[str, dict] = {}
        for r in range(args.rounds):
            for name, (before, k) in configs.items():
                code = CHILD.format(before=before, k=k, workload=workload, text=text)
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"{workload:>5} round {r} {name:>4}: " + json.dumps(res), flush=True)
                if name not in best or res["wall"] < best[name]["wall"]:
                    best[name] = res
        off = best["off"]["wall"]
        for name, res in best.items():
            print(
                f"{workload:>5} best {name:>4}: {res['wall']:.2f} s, {res['tok_s']:.1f} tok/s, {res['steps']} steps, "
                f"{res['drafts']} drafts / {res['kept']} kept, off/this {off / res['wall']:.2f}x, "
                f"outputs {res['digest']}"
            )


if __name__ == "__main__":
    main()
