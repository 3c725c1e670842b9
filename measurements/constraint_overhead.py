"""Constraint overhead at equal work, on the default model: the same prompts and the same number of generated
tokens per row, constrained vs unconstrained (``ignore_eos``, ``max_new_tokens`` = the constrained row's
length), back to back, twice, each run with a cold prefix cache.

Usage: python measurements/constraint_overhead.py examples/reviews.jsonl SCHEMA.json [ROWS]
"""

from __future__ import annotations

import argparse
import json
import time

from batchjob import Engine, SamplingParams

LABEL = "Is this review positive, negative or neutral? Answer with one word."
EXTRACT = (
    "Extract the sentiment (positive, negative or neutral), the product, the stars (1-5) and a one-line "
    "summary of this review, as JSON."
)


def main(reviews: str, schema_file: str, num_rows: int) -> None:
    engine = Engine.from_pretrained(None, device="cpu", dtype="float32")
    with open(reviews) as f:
        rows = [json.loads(line) for line in f][:num_rows]
    with open(schema_file) as f:
        schema = json.load(f)

    def prompt(task: str, row: dict) -> list[int]:
        msgs = [{"role": "user", "content": f"{task}\n\nReview: {row['review']}"}]
        return engine.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def timed(prompts, params):
        bm = engine.block_manager
        bm.__init__(bm.num_blocks, bm.block_size)  # a cold prefix cache for every run
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - t, [len(o.token_ids) for o in outs]

    label = [prompt(LABEL, r) for r in rows]
    extract = [prompt(EXTRACT, r) for r in rows]
    engine.generate(label[:2], SamplingParams(max_new_tokens=2, temperature=0))  # warm-up
    choices = SamplingParams(temperature=0, choices=["positive", "negative", "neutral"])
    as_json = SamplingParams(temperature=0, max_new_tokens=96, json_schema=schema)
    for rnd in (1, 2):
        tc, lens = timed(label, choices)
        tf, _ = timed(label, [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lens])
        tj, jlens = timed(extract, as_json)
        tg, _ = timed(
            extract, [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in jlens]
        )
        print(
            f"round {rnd}: choices {tc:.1f}s vs free same tokens {tf:.1f}s -> throughput ratio {tf / tc:.3f}; "
            f"json {tj:.1f}s ({sum(jlens)} tokens) vs free same tokens {tg:.1f}s -> throughput ratio {tg / tj:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reviews", help="a JSONL file of reviews (examples/reviews.jsonl)")
    ap.add_argument("schema", help="the JSON schema file of the extraction rows")
    ap.add_argument("rows", nargs="?", type=int, default=40, help="how many rows (40)")
    args = ap.parse_args()
    main(args.reviews, args.schema, args.rows)
