"""The benchmark's workload: token-id prompts and per-request output lengths, the same for every engine.

Synthetic prompts are random token ids from a fixed seed, lengths log-uniform (mostly short, a long tail);
a dataset file gives real texts instead. Output lengths are drawn from the same seeded generator.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator
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
    note: str | None = None  # a dataset's: the prompts cut, rows skipped, requests short of those asked for

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
        } | ({"note": self.note} if self.note else {})


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


_BAD_JSON = object()  # a JSONL line that is not JSON, as read


def read_texts(path: Path, limit: int) -> tuple[list[str], Counter[str]]:
    """The first ``limit`` non-empty ``prompt`` (else ``text``) values of a JSONL or Parquet file, and the
    rows before them that were skipped, by why (a benchmark needs prompts, not every row)."""
    if not path.is_file():
        raise InputError(f"--dataset {path}: no such file")
    texts: list[str] = []
    skipped: Counter[str] = Counter()
    for row in _rows(path):
        value = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if isinstance(value, str) and value.strip():
            texts.append(value)
            if len(texts) >= limit:
                break
        elif row is _BAD_JSON:
            skipped["not JSON"] += 1
        else:
            skipped["not an object" if not isinstance(row, dict) else "no non-empty 'prompt' or 'text'"] += 1
    if not texts:
        raise InputError(f"--dataset {path}: no row with a non-empty 'prompt' or 'text' string")
    return texts, skipped


def _rows(path: Path) -> Iterator[Any]:
    """The file's rows, in order: a JSONL line's value (:data:`_BAD_JSON` for a line that is not JSON), or a
    Parquet row's ``prompt`` (else ``text``) column as a dict."""
    suffix = "".join(path.suffixes[-2:]) if path.suffix in (".gz", ".zst") else path.suffix
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # (only for a Parquet dataset)

        names = pq.read_schema(path).names
        cols = [c for c in ("prompt", "text") if c in names]
        if not cols:
            raise InputError(f"--dataset {path}: no 'prompt' or 'text' column (columns: {', '.join(names)})")
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=cols[:1]):
            yield from batch.to_pylist()
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        yield _BAD_JSON
    else:
        raise InputError(f"--dataset {path}: expected a .jsonl or .parquet file")


def dataset_workload(
    path: Path, tokenizer: Any, num_requests: int, output_len: tuple[int, int], seed: int, max_prompt: int
) -> Workload:
    """The dataset's first ``num_requests`` usable texts, tokenized and cut to ``max_prompt`` tokens (the
    model's context less the longest output); ``note`` says what was cut or skipped, and when the file had
    fewer usable rows than asked for."""
    texts, skipped = read_texts(path, num_requests)
    ids = [tokenizer(t).input_ids for t in texts]
    prompts = [x[:max_prompt] or [0] for x in ids]
    rng = random.Random(seed)
    work = Workload(prompts, output_lengths(rng, len(prompts), *output_len), str(path))
    said = []
    if len(texts) < num_requests:
        said.append(
            f"{len(texts)} requests of the {num_requests} asked for (--num-requests): no more usable rows"
        )
    cut = sum(len(x) > max_prompt for x in ids)
    if cut:
        said.append(
            f"{cut} prompt{'s' * (cut > 1)} cut to the first {max_prompt} tokens "
            "(the model's context less --output-len's most)"
        )
    if skipped:
        why = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
        n = sum(skipped.values())
        said.append(f"{n} row{'s' * (n > 1)} skipped ({why})")
    work.note = f"--dataset {path}: " + "; ".join(said) if said else None
    return work
