"""The Python API: the engine on a few prompts, then a whole resumable job, from Python.

python examples/python_api.py [--model PATH]    (default: the embedded SmolLM2-135M-Instruct)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyarrow.dataset as ds

from batchjob import Engine, SamplingParams
from batchjob.job import make_spec, run_job

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local model folder or hub id")
    args = parser.parse_args()

    # 1. The engine alone: prompts in, completions out, in input order.
    engine = Engine.from_pretrained(args.model)
    for out in engine.generate(
        ["The capital of France is", "One, two, three,"], SamplingParams(max_new_tokens=8, temperature=0)
    ):
        print(f"{out.finish_reason:>6} | {out.text!r}")

    # 2. A job: stream a JSONL file through the same engine into Parquet parts (resumable: docs/jobs.md).
    with tempfile.TemporaryDirectory() as tmp:
        spec = make_spec(
            input=[str(HERE / "reviews.jsonl")],
            output=str(Path(tmp) / "labels"),
            model=args.model,
            id_column="review_id",
            template="Review: {review}\nSentiment (positive, negative or neutral):",
            choices=["positive", "negative", "neutral"],  # the answer is one of these labels, nothing else
            max_new_tokens=4,
        )
        result = run_job(spec, engine=engine)
        print(f"{result.status}: {result.rows_done} rows, {result.errors} errors")
        # The parts hold rows in the order they finished: sort by the id for input order. ``label`` is the
        # file's own label, ``generated_text`` the model's.
        table = ds.dataset(result.out_dir, format="parquet").to_table(
            columns=["review_id", "label", "generated_text"]
        )
        for row in table.sort_by("review_id").slice(0, 5).to_pylist():
            print(f"{row['review_id']}: file says {row['label']:<8} model says {row['generated_text']}")


if __name__ == "__main__":
    main()
