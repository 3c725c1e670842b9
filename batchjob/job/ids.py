"""Job-wide unique ids: an on-disk index from each ``--id-column`` value to the first row that holds it.

Ids are unique job-wide whatever the engine's settings: every row of the input stream (this worker's and, in a
job split over several workers, the others' too) passes through the index in stream order, and a row whose id
an earlier row already holds is a duplicate of that row. The index is a SQLite table of 16-byte id digests
and ordinals under the worker's state folder, so memory stays flat for any number of rows. It is a cache of
what the reader has seen: committed with every part (before the manifest records the part), it lets a
resumed run skip re-reading ids it has; if it is lost or damaged it is simply built again from the inputs.

Derived ids (``<file>:<row>``) are unique by construction and need no index.
"""

from __future__ import annotations

import errno
import hashlib
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
            for p in (path, path.with_name(path.name + "-journal")):
                p.unlink(missing_ok=True)
            with self._writing():
                self._open()

    def _open(self) -> None:
        self.db = sqlite3.connect(self.path, isolation_level="DEFERRED")
        self.db.execute("PRAGMA synchronous=FULL")  # committed before the manifest line it vouches for
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
            self.db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('seen_to', ?)", (self.seen_to,))
            self.db.commit()

    def close(self) -> None:
        self.db.close()
