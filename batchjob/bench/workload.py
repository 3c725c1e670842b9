"""The benchmark's workload: token-id prompts and per-request output lengths, the same for every engine.

Synthetic prompts are random token ids from a fixed seed, lengths log-uniform (mostly short, a long tail);
a dataset file gives real texts instead. Output lengths are drawn from the same seeded generator.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.errors import InputError


@dataclass
class Workload:
    """The requests every engine runs: token-id prompts and how many tokens each must generate."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    source: str  # "synthetic" or the dataset path

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "source": self.source,
            "num_requests": len(self.prompts),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_min_max": [min(lens), max(lens)],
            "output_len_min_max": [min(self.max_new_tokens), max(self.max_new_tokens)],
        }


def log_uniform_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths in [lo, hi], uniform in log space: most prompts short, a long tail."""
    a, b = math.log(lo), math.log(hi + 1)
    return [min(hi, max(lo, int(math.exp(rng.uniform(a, b))))) for _ in range(n)]


def output_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic_workload(
    vocab_size: int, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> Workload:
    """Random token-id prompts from a fixed seed: the same ids for every engine and every run."""
    rng = random.Random(seed)
    lengths = log_uniform_lengths(rng, num_requests, *prompt_len)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, output_lengths(rng, num_requests, *output_len), "synthetic")


def read_texts(path: Path, limit: int) -> list[str]:
    """The first ``limit`` non-empty ``prompt`` (else ``text``) values of a JSONL or Parquet file."""
    if not path.is_file():
        raise InputError(f"--dataset {path}: no such file")
    suffix = "".join(path.suffixes[-2:]) if path.suffix in (".gz", ".zst") else path.suffix
    rows: list[dict[str, Any]] = []
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        cols = [c for c in ("prompt", "text") if c in names]
        rows = pq.read_table(path, columns=cols[:1]).slice(0, limit * 2).to_pylist() if cols else []
        if not cols:
            raise InputError(f"--dataset {path}: no 'prompt' or 'text' column (columns: {', '.join(names)})")
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a bad line is skipped: a benchmark needs prompts, not every row
                    if isinstance(row, dict):
                        rows.append(row)
                if len(rows) >= limit * 2:
                    break
    else:
        raise InputError(f"--dataset {path}: expected a .jsonl or .parquet file")
    texts = []
    for row in rows:
        value = row.get("prompt", row.get("text"))
        if isinstance(value, str) and value.strip():
            texts.append(value)
    if not texts:
        raise InputError(f"--dataset {path}: no row with a non-empty 'prompt' or 'text' string")
    return texts[:limit]


def dataset_workload(
    path: Path, tokenizer: Any, num_requests: int, output_len: tuple[int, int], seed: int, max_prompt: int
) -> Workload:
    texts = read_texts(path, num_requests)
    prompts = [tokenizer(t).input_ids[:max_prompt] or [0] for t in texts]
    rng = random.Random(seed)
    return Workload(prompts, output_lengths(rng, len(prompts), *output_len), str(path))
