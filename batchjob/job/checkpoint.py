"""Committing a job's work: finished rows as Parquet parts listed in the manifest, and unfinished requests as
the in-flight checkpoint.

Both are atomic, and a checkpoint commits the finished rows before it saves the unfinished ones: whatever
moment the process dies at, every row is either in a committed part, in the checkpoint, or computed again.

An unfinished row is one ``InFlight`` record, whatever it is: one request, ``--n`` samples (each with its own
tokens), a reasoning row's thinking. In memory its tokens are always by sample index; on disk a one-sample
row keeps the ``output_ids`` key it always had and a row of several samples ``samples``. A record says which
row kind saved it (``kind``: ``rows/``) and, for a reasoning row, which samples had finished their thinking
(``answering``: their thinking is saved, their answer is asked again). A record without ``kind`` (written
before kinds were recorded) still loads: the row's prompt and parameters alone decide whether it is that
row's work, as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob import faults
from batchjob.io.writers import PartWriter
from batchjob.job.intervals import IntervalSet
from batchjob.job.manifest import Manifest, PartRecord


@dataclass
class InFlight:
    """A row's unfinished work at a checkpoint: its prompt and what each sample generated so far."""

    ordinal: int
    id: str
    prompt_ids: list[int]
    samples: dict[int, list[int]] = field(default_factory=dict)  # generated ids by sample index
    params: dict[str, Any] | None = None  # the row's own sampling parameters (jobs with per-row parameters)
    several: bool = False  # the row has several samples (--n): saved as "samples", else as "output_ids"
    kind: str | None = None  # the row kind that saved it ("generate", "reasoning"); None: not recorded
    answering: list[int] = field(default_factory=list)  # reasoning: samples past their thinking

    def matches(self, row_id: str, prompt_ids: list[int], params: dict[str, Any], kind: str) -> bool:
        """Whether this record is the work of that request (the same id, kind, prompt and parameters)."""
        return (
            self.id == row_id
            and self.kind in (None, kind)
            and self.prompt_ids == prompt_ids
            and (self.params is None or self.params == params)
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ordinal": self.ordinal, "id": self.id, "prompt_ids": self.prompt_ids}
        if self.kind is not None:
            out["kind"] = self.kind
        if self.answering:
            out["answering"] = self.answering
        if self.params is not None:
            out["params"] = self.params
        if self.several:
            out["samples"] = {str(k): v for k, v in self.samples.items()}
        else:
            out["output_ids"] = self.samples.get(0, [])
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InFlight:
        """A record as saved (raises KeyError, TypeError or ValueError for a malformed one)."""
        several = "samples" in d
        if several:
            samples = {int(k): list(v) for k, v in d["samples"].items()}
        else:
            samples = {0: list(d["output_ids"])} if d.get("output_ids") else {}
        kind = d.get("kind")
        return cls(
            int(d["ordinal"]),
            str(d["id"]),
            list(d["prompt_ids"]),
            samples,
            d.get("params"),
            several,
            None if kind is None else str(kind),
            [int(k) for k in d.get("answering", [])],
        )


class Parts:
    """Finished rows, buffered and then committed as one part: written atomically, then listed in the
    manifest (a part not in the manifest does not exist)."""

    def __init__(self, out_dir: Path, manifest: Manifest, writer: PartWriter) -> None:
        self.out_dir = out_dir
        self.manifest = manifest
        self.writer = writer
        self.buffer: list[dict[str, Any]] = []
        self.ordinals = IntervalSet()
        self.unread: set[int] = set()

    def add(
        self, ordinal: int, result: dict[str, Any], samples: list[dict[str, Any]], unread: bool = False
    ) -> None:
        """Buffer an input row's result rows: ``result`` (the columns they share) with each of ``samples``'
        own columns (--n gives several, all buffered at once so they land in one part). ``unread``: the row is
        its file's unreadable rest (the part's record says so: a resume reads past it only then)."""
        for extra in samples:
            self.buffer.append({"ordinal": ordinal} | result | extra)
        self.ordinals.add(ordinal)
        if unread:
            self.unread.add(ordinal)

    def commit(self) -> None:
        if not self.buffer:
            return
        rows = sorted(self.buffer, key=lambda r: (r["ordinal"], r.get("sample_index", 0)))
        name = self.writer.write(self.writer.next_seq(self.manifest.names), rows)
        self.manifest.append(
            PartRecord(
                name=name,
                rows=len({r["ordinal"] for r in rows}),  # input rows (--n writes several result rows each)
                # input rows with an error (in any sample), and each input row's prompt once
                errors=len({r["ordinal"] for r in rows if r["error"] is not None}),
                prompt_tokens=sum(r["num_prompt_tokens"] or 0 for r in rows if not r.get("sample_index")),
                generated_tokens=sum(r["num_generated_tokens"] or 0 for r in rows),
                ordinals=self.ordinals.ranges(),
                result_rows=len(rows),
                **self.writer.stamp(name),
                unread=sorted(self.unread),
            )
        )
        self.buffer = []
        self.ordinals = IntervalSet()
        self.unread = set()
        faults.point("part_committed")
