"""Rows, errors and tokens per LoRA adapter, counted from a job's committed parts (their ``adapter``
column): what ``batchjob status`` prints and ``batchjob report`` tabulates, one count for both.

Only the parts a status vouches for are read (the caller names them: missing or damaged ones are left out,
as their rows are not done), and only four columns of them, a batch at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.job.verify import DamagedPartError, read_batches

BASE = ""  # the base model's key: a row with no adapter (null or empty in the adapter column)
UNRUN = "\x00"  # the key of error rows that failed before any request (no prompt, an unknown adapter...)
_COLUMNS = ("adapter", "error", "num_prompt_tokens", "num_generated_tokens", "sample_index")


@dataclass
class AdapterCounts:
    """One adapter's committed rows (an error row counts under the adapter its result names): input rows, not
    their --n samples' result rows, and each prompt's tokens once, as the prompt is computed once."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


def adapter_counts(out_dir: Path, parts: Iterable[str], names: Iterable[str]) -> dict[str, AdapterCounts]:
    """Counts by adapter name (:data:`BASE` for the base model) over ``parts`` (committed part names under
    ``out_dir``); every adapter of ``names`` (the job's) is there, with zeros until a row of it is done."""
    counts = {name: AdapterCounts() for name in [BASE, *names]}
    for name in parts:
        try:
            schema = pq.read_schema(out_dir / name)
        except (OSError, pa.ArrowException) as e:
            raise DamagedPartError(out_dir, name, f"cannot be read ({e})") from e
        columns = [c for c in _COLUMNS if c in schema.names]
        if "adapter" not in columns:  # not a LoRA job's part
            continue
        for batch in read_batches(out_dir, name, batch_size=4096, columns=columns):
            for r in batch.to_pylist():
                # a row that failed before it ran has no adapter, and is not the base model's either
                unrun = not r["adapter"] and r.get("error") is not None and not r.get("num_prompt_tokens")
                c = counts.setdefault(UNRUN if unrun else r["adapter"] or BASE, AdapterCounts())
                first = not r.get("sample_index")  # a row's first sample (a row of one has none)
                c.rows += first
                c.errors += first and r.get("error") is not None
                c.prompt_tokens += (r.get("num_prompt_tokens") or 0) if first else 0
                c.generated_tokens += r.get("num_generated_tokens") or 0
    return counts


def adapter_label(name: str) -> str:
    """How an adapter is named to the user."""
    return {BASE: "(base model)", UNRUN: "(no adapter: failed before it ran)"}.get(name, name)
