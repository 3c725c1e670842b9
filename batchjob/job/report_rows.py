"""What the committed parts of a job say, for ``batchjob report`` to draw: prompt and output lengths, finish
reasons, errors by kind with example rows, and the labels of a ``--choices`` or ``--task classify`` job,
read a batch at a time (a few columns, never the whole job). It reads; it draws nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io.writers import input_column
from batchjob.job.manifest import Manifest
from batchjob.job.shard import Shard
from batchjob.job.state import StateDir
from batchjob.job.verify import DamagedPartError, read_batches

LENGTH_EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 10**9]
_EXAMPLES = 3


@dataclass
class Outputs:
    """What the committed parts of a job say, gathered a batch at a time."""

    rows: int = 0  # result rows (--n: several an input row)
    prompt_lengths: list[int] = field(default_factory=lambda: [0] * (len(LENGTH_EDGES) - 1))
    output_lengths: list[int] = field(default_factory=lambda: [0] * (len(LENGTH_EDGES) - 1))
    finish_reasons: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    labels: Counter = field(default_factory=Counter)


def _bucket(edges: list[int], x: int) -> int:
    for i in range(len(edges) - 1):
        if x < edges[i + 1]:
            return i
    return len(edges) - 2


def error_kind(message: str) -> str:
    """An error message without its particulars (names, numbers, ids): what kind of error it is."""
    kind = re.sub(r"^\S+ line \d+: ", "", message)
    kind = re.sub(r"'[^']*'|\"[^\"]*\"", "…", kind)
    kind = re.sub(r"\d+", "N", kind)
    return kind[:120]


def read_outputs(
    out_dir: Path, choices: bool, id_column: str | None, skip: AbstractSet[str] = frozenset()
) -> Outputs:
    """What the job's committed parts hold, but for the parts named in ``skip`` (missing or damaged ones:
    ``verify.check_part``'s verdict, which ``status`` shows too)."""
    info = StateDir(out_dir).load_job()
    count = int((info.fingerprint.get("sharding") or {}).get("num_shards", 1))
    manifests = [StateDir(out_dir, Shard(i, count)).manifest_file for i in range(count)]
    out = Outputs()
    for path in manifests:
        if not path.exists():
            continue
        for record in Manifest(path, readonly=True).parts:
            part = out_dir / record.name
            if record.name in skip or not part.exists():
                continue
            try:
                schema = pq.read_schema(part)
            except (OSError, pa.ArrowException) as e:
                raise DamagedPartError(out_dir, record.name, f"cannot be read ({e})") from e
            # generation's columns; a prefill-only task's parts have no finish reason or output length
            # (their generation-only figures are left out), a classify job's have its label
            columns = ["num_prompt_tokens", "num_generated_tokens", "finish_reason", "error", "label"]
            columns.append("sample_index")  # --n, several inputs: a row's result rows after its first
            names = set(schema.names)
            id_col = input_column(schema, id_column) if id_column else None  # renamed when it clashed
            columns += [c for c in (id_col, "generated_text" if choices else None) if c]
            columns = [c for c in columns if c in names]
            generated = "finish_reason" in names
            for batch in read_batches(out_dir, record.name, batch_size=4096, columns=columns):
                for r in batch.to_pylist():
                    out.rows += 1
                    if generated:
                        out.finish_reasons[r["finish_reason"] or "unknown"] += 1
                    if r["error"] is not None:
                        kind = error_kind(r["error"])
                        out.errors[kind] += 1
                        examples = out.error_examples.setdefault(kind, [])
                        if len(examples) < _EXAMPLES:
                            examples.append((str(r.get(id_col) if id_col else "") or "", r["error"]))
                        continue
                    if not r.get("sample_index"):  # the input row's prompt, once (its samples share it)
                        out.prompt_lengths[_bucket(LENGTH_EDGES, r["num_prompt_tokens"] or 0)] += 1
                    if generated:
                        out.output_lengths[_bucket(LENGTH_EDGES, r["num_generated_tokens"] or 0)] += 1
                    if choices and r.get("generated_text") is not None:
                        out.labels[r["generated_text"]] += 1
                    elif r.get("label") is not None and not generated:  # --task classify
                        out.labels[r["label"]] += 1
    return out
