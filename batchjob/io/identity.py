"""What a file is, by content: size, time stamp and a digest cheap enough for terabyte inputs.

A file up to ``FULL_BYTES`` is hashed whole. A larger one is hashed by samples: its first and last MiB and
62 blocks of 64 KiB spread evenly between (about 6 MiB read, whatever the size), with the size mixed in. So a
changed small file is always noticed; a changed large file is noticed when the change moves its size or
touches a sampled block, and otherwise only by its time stamp (see ``batchjob.job.inputs``).

The digest of the first ``n`` bytes of a file is computed the same way as the digest of a file of size
``n``; that is how an append-only file is recognised: the digest of its old length is still the old digest.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FULL_BYTES = 16 << 20  # hashed whole up to this size
_EDGE = 1 << 20  # head and tail of a sampled file
_BLOCK = 64 << 10  # each sampled block between them
_BLOCKS = 62
_CHUNK = 4 << 20  # read size of a whole-file hash

ReadAt = Callable[[int, int], bytes]  # (offset, length) -> bytes


def digest_of(read_at: ReadAt, size: int) -> str:
    """``full:<sha256>`` of the first ``size`` bytes when small, else ``sampled:<sha256>`` of samples."""
    h = hashlib.sha256()
    if size <= FULL_BYTES:
        offset = 0
        while offset < size:
            data = read_at(offset, min(_CHUNK, size - offset))
            if not data:
                raise OSError(f"file ended at byte {offset} of {size}")
            h.update(data)
            offset += len(data)
        return "full:" + h.hexdigest()
    h.update(b"batchjob-sampled-v1" + size.to_bytes(8, "little"))
    spans = [(0, _EDGE)]
    span = size - _EDGE - _BLOCK
    spans += [(_EDGE + span * j // (_BLOCKS + 1), _BLOCK) for j in range(1, _BLOCKS + 1)]
    spans.append((size - _EDGE, _EDGE))
    for offset, length in spans:
        data = read_at(offset, length)
        if len(data) != length:
            raise OSError(f"file ended before byte {offset + length} of {size}")
        h.update(data)
    return "sampled:" + h.hexdigest()


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


def local_reader(path: str | os.PathLike[str]) -> tuple[ReadAt, Callable[[], None]]:
    """``(read_at, close)`` over a local file, by ``pread``."""
    fd = os.open(path, os.O_RDONLY)

    def read_at(offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            data = os.pread(fd, length - len(out), offset + len(out))
            if not data:
                break
            out += data
        return bytes(out)

    return read_at, lambda: os.close(fd)


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


def folder_files(folder: Path, skip: Callable[[str], bool] = lambda rel: False) -> list[tuple[str, Path]]:
    """``(relative name, path)`` of every regular file under ``folder`` (hidden ones and ``skip`` left out),
    sorted by name; symbolic links are followed (a Hugging Face cache snapshot is made of them)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in filenames:
            full = Path(dirpath) / f
            rel = full.relative_to(folder).as_posix()
            if f.startswith(".") or skip(rel) or not full.is_file():
                continue
            out.append((rel, full))
    return sorted(out)


def folder_digest(folder: Path, skip: Callable[[str], bool] = lambda rel: False) -> dict[str, str]:
    """``{relative name: "<size>:<digest>"}`` for the files of a folder."""
    out = {}
    for rel, path in folder_files(folder, skip):
        ident = identify_local(path)
        out[rel] = f"{ident.size}:{ident.digest}"
    return out


def combine(parts: dict[str, str]) -> str:
    """One digest over named digests (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}\0{parts[name]}\n".encode())
    return h.hexdigest()
