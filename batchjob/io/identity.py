"""What a file is, by content: size, time stamp and a digest cheap enough for terabyte inputs (the digest is
``batchjob.digest``'s: small files whole, large ones by samples).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchjob.digest import (  # (re-exported: the job layer names them here)
    FULL_BYTES,
    ReadAt,
    combine,
    digest_of,
    folder_files,
    local_reader,
)

__all__ = [
    "FULL_BYTES",
    "FileIdentity",
    "ReadAt",
    "byte_at",
    "combine",
    "digest_of",
    "folder_digest",
    "folder_files",
    "identify_local",
    "local_reader",
    "stat_local",
]


@dataclass(frozen=True)
class FileIdentity:
    size: int
    mtime_ns: int | None  # None where the filesystem does not say
    digest: str
    # A local file's inode and status-change time. Unlike the time stamp, the status-change time can't be set
    # back (``touch -d``, ``cp -p``, a rename: each moves it), so with the inode it says whether the file
    # is the very one, untouched, that was read.
    ino: int | None = None
    ctime_ns: int | None = None

    @property
    def sampled(self) -> bool:
        return self.digest.startswith("sampled:")


def identify_local(path: str | os.PathLike[str], prefix: int | None = None) -> FileIdentity:
    """The identity of a local file (or of its first ``prefix`` bytes: same size field, that digest)."""
    st = os.stat(path)
    read_at, close = local_reader(path)
    try:
        size = st.st_size if prefix is None else prefix
        return FileIdentity(st.st_size, st.st_mtime_ns, digest_of(read_at, size), st.st_ino, st.st_ctime_ns)
    finally:
        close()


def stat_local(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    """``(size, mtime_ns, inode, ctime_ns)``."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def byte_at(path: str | os.PathLike[str], offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)


def folder_digest(folder: Path, skip: Callable[[str], bool] = lambda rel: False) -> dict[str, str]:
    """``{relative name: "<size>:<digest>"}`` for the files of a folder."""
    out = {}
    for rel, path in folder_files(folder, skip):
        ident = identify_local(path)
        out[rel] = f"{ident.size}:{ident.digest}"
    return out
