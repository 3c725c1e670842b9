"""Job-wide unique ids: an on-disk index from each ``--id-column`` value to the first row that holds it.

Ids are unique job-wide whatever the engine's settings: every row of the input stream (this worker's and, in a
job split over several workers, the others' too) passes through the index in stream order, and a row whose id
an earlier row already holds is a duplicate of that row. The index is a SQLite table of 16-byte id digests
and ordinals under the worker's state folder, so memory stays flat for any number of rows (SQLite's page cache
is capped at 64 MiB). It is a cache of what the reader has seen, saved with the number of rows it covers
(``seen_to``) in the same transaction: a resumed run reads the ids of the rows after that again, done or
not, in stream order, so an index that lags behind the parts (it is committed at checkpoints only, in WAL
mode, which costs a few microseconds a row) or is lost or damaged is simply brought up to date from the
inputs.

Derived ids (``<file>:<row>``) are unique by construction and need no index.

``check_unique`` is the strict form, for an OpenAI Batch file (``--format openai``): a ``custom_id`` used
twice rejects the whole file before any work, as OpenAI's Batch API does (the two lines are named).
"""

from __future__ import annotations

import errno
import hashlib
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from batchjob.errors import InputError
from batchjob.io.atomic import DiskFullError, disk_full_message

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ids (key BLOB PRIMARY KEY, ordinal INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def _key(value: str) -> bytes:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class IdIndex:
    """``first(id, ordinal)``: the ordinal of an earlier row with the same id, or None."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with self._writing():
                self._open()
        except sqlite3.DatabaseError as e:
            print(f"batchjob: the id index {path} is damaged ({e}); building it again", file=sys.stderr)
            self._remove()
            with self._writing():
                self._open()

    def _remove(self) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)

    def _open(self) -> None:
        if not self.path.exists():
            self._remove()  # a write-ahead log left without its database must not be applied to a new one
        self.db = sqlite3.connect(self.path, isolation_level="DEFERRED")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # a lost last commit only means re-reading some ids
        self.db.execute("PRAGMA cache_size=-65536")  # KiB
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE name = 'seen_to'").fetchone()
        self.seen_to: int = row[0] if row else 0  # every ordinal below this one is in the index
        self._insert = "INSERT OR IGNORE INTO ids (key, ordinal) VALUES (?, ?)"

    @contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as e:
            if "full" in str(e):  # SQLITE_FULL: the disk (or quota) is full
                raise DiskFullError(disk_full_message(OSError(errno.ENOSPC, str(e)), self.path)) from e
            raise

    def first(self, value: str, ordinal: int) -> int | None:
        """Record that the row ``ordinal`` holds id ``value``; return an earlier row's ordinal if one does."""
        key = _key(value)
        with self._writing():
            cur = self.db.execute(self._insert, (key, ordinal))
        if cur.rowcount:
            return None
        (held,) = self.db.execute("SELECT ordinal FROM ids WHERE key = ?", (key,)).fetchone()
        if held < ordinal:
            return held
        if held > ordinal:  # seen first at a later row (it can't be, rows come in order): this one is first
            self.db.execute("UPDATE ids SET ordinal = ? WHERE key = ?", (ordinal, key))
        return None

    def seen(self, ordinal: int) -> None:
        """Every row before ``ordinal`` (in stream order) has been recorded."""
        self.seen_to = max(self.seen_to, ordinal)

    def commit(self) -> None:
        with self._writing():
            self.db.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES ('seen_to', ?)", (self.seen_to,)
            )
            self.db.commit()

    def close(self) -> None:
        self.db.close()


def check_unique(sources: list[Any], column: str, what: str) -> None:
    """Raise ``InputError`` naming both lines if two rows of ``sources`` hold the same ``column`` value.

    Reads the inputs once, keeping the ids in a temporary SQLite table (flat memory for any number of
    rows). Rows that can't be parsed, or have no such value, are left to the job (their own error rows)."""
    from batchjob.io.readers import iter_rows

    with TemporaryDirectory(prefix="batchjob-ids-") as tmp:
        db = sqlite3.connect(Path(tmp) / "ids.sqlite", isolation_level=None)
        try:
            db.execute("CREATE TABLE ids (key BLOB PRIMARY KEY, place TEXT NOT NULL) WITHOUT ROWID")
            db.execute("BEGIN")
            for row in iter_rows(sources):
                value = row.values.get(column) if row.values is not None else None
                if value is None or isinstance(value, (dict, list)):
                    continue
                place = (
                    f"{row.source} line {row.line}"
                    if row.line is not None
                    else f"{row.source} row {row.index}"
                )
                key = _key(str(value))
                if db.execute("INSERT OR IGNORE INTO ids VALUES (?, ?)", (key, place)).rowcount:
                    continue
                (first,) = db.execute("SELECT place FROM ids WHERE key = ?", (key,)).fetchone()
                raise InputError(
                    f"{place}: {what} {value!r} is already used by {first}; {what}s must be unique in an "
                    f"OpenAI Batch file (OpenAI's Batch API rejects such a file too): give each request its "
                    "own and run again"
                )
        finally:
            db.close()
