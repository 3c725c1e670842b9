"""Files changed atomically: write a temporary name, flush, fsync, rename, fsync the folder.

A reader of one of these files sees either the old content or the new one, never a torn mix. JSON state files
also carry a checksum of their body, so a file damaged some other way is detected rather than trusted.

A write that fails (a full disk, an interrupt) removes its temporary file; a full disk (or quota) raises
DiskFullError, which names the file and says the job can be resumed once there is space.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from batchjob import faults
from batchjob.errors import BatchjobError, StateError

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class CorruptStateError(StateError):
    """A state file is torn, not JSON, or fails its checksum (not merely unreadable)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"state file {path} {reason}; restore it from a backup, or run the job into a new --output "
            "(the Parquet parts already written stay valid: keep them)"
        )
        self.path = path
        self.reason = reason


class DiskFullError(BatchjobError):
    """No space (or quota) left while writing a part or a state file; what was committed is kept."""

    exit_code = 1


def is_disk_full(e: OSError) -> bool:
    """ENOSPC or EDQUOT, also as pyarrow words it: ``Error writing bytes to file ... [errno 28]``."""
    text = str(e).lower()
    return e.errno in _DISK_FULL or any(f"[errno {n}]" in text for n in _DISK_FULL)


def disk_full_message(e: OSError, where: Path | str | None) -> str:
    """``no space left on device writing PATH; free space and run the same command again: ...``"""
    quota = e.errno == errno.EDQUOT or f"[errno {errno.EDQUOT}]" in str(e).lower()
    what = "disk quota exceeded" if quota else "no space left on device"
    at = f" writing {where}" if where else ""
    return f"{what}{at}; free space and run the same command again: finished rows are kept"


@contextmanager
def writing(tmp: Path) -> Iterator[None]:
    """Around writing ``tmp`` and renaming it into place: on any failure remove ``tmp``; a full disk becomes
    DiskFullError naming it (pyarrow's own error names no file)."""
    try:
        yield
    except BaseException as e:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and is_disk_full(e):
            raise DiskFullError(disk_full_message(e, tmp)) from e
        raise


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: Path, final: Path) -> None:
    """fsync ``tmp`` (already written and closed), rename it onto ``final`` and fsync the folder."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
        faults.disk_write(path.name)
        replace_file(tmp, path)


def _digest(body: Any) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_json(path: Path, body: Any) -> None:
    """Atomically write ``{"checksum": ..., "body": body}``."""
    data = json.dumps({"checksum": _digest(body), "body": body}, ensure_ascii=False, indent=1)
    write_bytes(path, data.encode())


def read_json(path: Path) -> Any:
    """Read a file written by :func:`write_json`; a torn or altered file raises StateError naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise StateError(f"state file {path} cannot be read: {e.strerror or e}") from e
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise CorruptStateError(path, f"is torn or not JSON ({e})") from e
    if not isinstance(doc, dict) or "body" not in doc or doc.get("checksum") != _digest(doc["body"]):
        raise CorruptStateError(path, "fails its checksum, so it is not trusted")
    return doc["body"]
