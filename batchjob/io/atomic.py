"""Files changed atomically: write a temporary name, flush, fsync, rename, fsync the folder.

A reader of one of these files sees either the old content or the new one, never a torn mix. JSON state files
also carry a checksum of their body, so a file damaged some other way is detected rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from batchjob.errors import StateError


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
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
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
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise StateError(
            f"state file {path} is unreadable or torn ({e}); delete the output folder to start over"
        ) from e
    if not isinstance(doc, dict) or "body" not in doc or doc.get("checksum") != _digest(doc["body"]):
        raise StateError(f"state file {path} fails its checksum: it is corrupt and will not be trusted")
    return doc["body"]
