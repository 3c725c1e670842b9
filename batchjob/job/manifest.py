"""The manifest: the list of committed parts. A part it does not list does not exist.

One JSON line per part, each with a checksum of its own content, appended and fsynced after the part file
was renamed into place. A crash during an append leaves a torn last line: that part was never committed, so
the line is cut off (and the part deleted as an orphan). A bad line anywhere else means the file was damaged:
that raises StateError, because a manifest we cannot trust cannot tell what is done.

Dropping parts (a damaged part to redo, a part rewritten without its error rows) rewrites the whole file
atomically: all kept records to a temporary file, fsync, rename, fsync the folder. A reader sees the old list
or the new one; a part file the new list no longer names is an orphan that the next start deletes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchjob.errors import StateError
from batchjob.io.atomic import write_bytes
from batchjob.job.intervals import IntervalSet


@dataclass
class PartRecord:
    name: str
    rows: int
    errors: int
    prompt_tokens: int
    generated_tokens: int
    ordinals: list[list[int]] = field(default_factory=list)  # half-open ranges of input row ordinals
    # What the part file must look like (None in records written before they were recorded):
    size: int | None = None  # bytes of the part file
    result_rows: int | None = None  # rows in its Parquet footer (--n writes n per input row)
    sha256: str | None = None  # of the whole file, read back at commit
    ino: int | None = None  # the file's inode and status-change time after its rename: while both are
    ctime_ns: int | None = None  # unchanged nothing wrote to it, so its content need not be read again
    unread: list[int] = field(default_factory=list)  # ordinals whose row is its file's unreadable rest


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


class Manifest:
    """The committed parts of one worker. ``readonly``: for those who only look (``status``, ``export``, a
    start before it holds the lock): a torn last line is left out, not cut off the file, where a running
    worker may be appending it."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.parts: list[PartRecord] = []
        self.done = IntervalSet()
        if path.exists():
            self._load()

    def _load(self) -> None:
        *lines, tail = self.path.read_bytes().split(b"\n")
        good = 0  # bytes of trusted lines
        for i, raw in enumerate(lines):
            record = self._parse(raw)
            if record is None:
                if i == len(lines) - 1 and not tail:
                    break  # a bad last line: torn like a tail without its newline
                raise StateError(
                    f"manifest {self.path} line {i + 1} is corrupt; the job's state cannot be trusted"
                )
            self._remember(record)
            good += len(raw) + 1
        else:
            if not tail:
                return
        # torn by a crash mid-append: that part was never committed
        if self.readonly:
            return
        print(f"batchjob: dropping the torn last line of {self.path} (a crash mid-commit)", file=sys.stderr)
        with open(self.path, "rb+") as f:
            f.truncate(good)
            os.fsync(f.fileno())

    @staticmethod
    def _parse(raw: bytes) -> PartRecord | None:
        try:
            doc = json.loads(raw)
            body = doc["part"]
            return PartRecord(**body) if doc.get("sha") == _digest(body) else None
        except (ValueError, KeyError, TypeError):
            return None

    def _remember(self, record: PartRecord) -> None:
        self.parts.append(record)
        for a, b in record.ordinals:
            self.done.add_range(a, b)

    @staticmethod
    def _line(record: PartRecord) -> bytes:
        body = asdict(record)
        return (json.dumps({"part": body, "sha": _digest(body)}, separators=(",", ":")) + "\n").encode()

    def append(self, record: PartRecord) -> None:
        with open(self.path, "ab") as f:
            f.write(self._line(record))
            f.flush()
            os.fsync(f.fileno())
        self._remember(record)

    def rewrite(self, records: list[PartRecord]) -> None:
        """Replace the whole list with ``records``, atomically (temporary file, fsync, rename, fsync folder)."""
        write_bytes(self.path, b"".join(self._line(r) for r in records))
        self.parts = []
        self.done = IntervalSet()
        for record in records:
            self._remember(record)

    @property
    def names(self) -> set[str]:
        return {p.name for p in self.parts}

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def errors(self) -> int:
        return sum(p.errors for p in self.parts)

    @property
    def unread(self) -> set[int]:
        """The ordinals done as the error row of their file's unreadable rest (readers.py)."""
        return {o for p in self.parts for o in p.unread}

    @property
    def prompt_tokens(self) -> int:
        return sum(p.prompt_tokens for p in self.parts)

    @property
    def generated_tokens(self) -> int:
        return sum(p.generated_tokens for p in self.parts)


class ErrorCounts:
    """The failed rows committed in other workers' manifests, for a job-wide ``--max-errors``. A file is read
    again only when its size, time stamp or inode changed (a worker appends a line per part, and rewrites the
    file by a rename), so a look at every checkpoint costs one ``stat`` per worker that committed nothing new.

    ``retrying`` (``--retry-errors``): a worker's count is taken from the lowest it has been seen at, for the
    others of a job run again with ``--retry-errors`` drop their failed rows as they start, a moment apart:
    rows about to be redone must not stop the worker that started first.
    """

    def __init__(self, paths: list[Path], retrying: bool = False) -> None:
        self.paths = paths
        self.retrying = retrying
        self._seen: dict[Path, tuple[tuple[int, int, int], int]] = {}  # path -> (its stat, its errors)
        self._lowest: dict[Path, int] = {}  # path -> the fewest errors seen in it (``retrying``)

    def total(self) -> int:
        total = 0
        for path in self.paths:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # that worker has committed nothing yet
            key, seen = (st.st_size, st.st_mtime_ns, st.st_ino), self._seen.get(path)
            if seen is None or seen[0] != key:
                try:
                    errors = Manifest(path, readonly=True).errors
                except StateError:  # damaged: its own worker refuses to go on, and status says so
                    errors = seen[1] if seen is not None else 0
                seen = self._seen[path] = (key, errors)
            low = self._lowest[path] = min(self._lowest.get(path, seen[1]), seen[1])
            total += seen[1] - (low if self.retrying else 0)
        return total
