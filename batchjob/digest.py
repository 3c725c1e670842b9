"""What bytes are, by content: the digest a job's identity is made of, shared by the job layer (inputs, models,
adapters: ``batchjob.io.identity``) and the engine, which digests the adapter files it reads as it reads them.

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


def bytes_part(data: bytes) -> str:
    """``"<size>:<digest>"`` of bytes in memory: what ``folder_digest`` records of a file holding them."""
    return f"{len(data)}:{digest_of(lambda offset, length: data[offset : offset + length], len(data))}"


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


def combine(parts: dict[str, str]) -> str:
    """One digest over named digests (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}\0{parts[name]}\n".encode())
    return h.hexdigest()
