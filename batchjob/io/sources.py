"""Turning ``--input`` values (files, folders, globs, remote URLs) into an ordered list of sources.

Each source gets a stable ``name``: its path relative to the folder its ``--input`` value points into, so a
row's derived id (``"reviews.jsonl:17"``) does not depend on where the job runs. The order is sorted and
fixed, which makes the position of every row in the whole stream (its ordinal) the same on every run.
"""

from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from batchjob.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
PARQUET_SUFFIXES = (".parquet", ".pq")
ORDINAL_BITS = 40  # row i of the file with sequence number s has the ordinal s << 40 | i (up to 2**40 rows)
# Counting the lines of an uncompressed JSONL file is cheap below this size; above it the total stays unknown
# until the reader reaches the end.
_COUNT_LIMIT_BYTES = 64 << 20


@dataclass(frozen=True)
class Source:
    """One input: a Parquet or JSONL file, or a folder written by ``datasets.save_to_disk``."""

    path: str  # local path or remote URL
    name: str  # stable name used in derived row ids
    kind: str  # "parquet" | "jsonl" | "hf"
    base: int = 0  # ordinal of its first row (batchjob.job.inputs: the file's sequence number << 40)

    @property
    def remote(self) -> bool:
        return "://" in self.path and not self.path.startswith("file://")


def kind_of(path: str) -> str | None:
    low = path.lower()
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def is_compressed(source: Source) -> bool:
    return source.path.lower().endswith((".gz", ".zst"))


def is_hf_folder(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in Path(rel).parts)


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:
        raise InputError("remote inputs need fsspec: pip install 'batchjob[remote]'") from e
    return fsspec


def _expand_remote(value: str) -> list[tuple[str, str]]:
    fsspec = _fsspec()
    try:
        fs, _, paths = fsspec.get_fs_token_paths(value)
    except (ImportError, ValueError) as e:
        raise InputError(f"cannot open input {value}: {e} (install the filesystem package for it)") from e
    protocol = value.split("://", 1)[0]
    root = value.split("://", 1)[1]
    if glob.has_magic(root):
        root = os.path.dirname(root[: min(root.index(c) for c in "*?[" if c in root)])
    else:
        root = os.path.dirname(root)
    found: list[tuple[str, str]] = []
    for p in paths:
        if fs.isdir(p):
            for f in sorted(fs.find(p)):
                rel = os.path.relpath(f, p)
                if kind_of(f) and not _hidden(rel):
                    found.append((f"{protocol}://{f}", rel))
        elif fs.exists(p):
            found.append((f"{protocol}://{p}", os.path.relpath(p, root) if root else p))
    return found


def _inside(path: str, folder: Path | None) -> bool:
    if folder is None:
        return False
    resolved = Path(path).resolve()
    return resolved == folder or folder in resolved.parents


def _expand_local(value: str, exclude: Path | None) -> list[tuple[str, str]]:
    if value.startswith("file://"):
        value = value[len("file://") :]
    if glob.has_magic(value):
        matches = sorted(glob.glob(value, recursive=True))
        prefix = value[: min(value.index(c) for c in "*?[" if c in value)]
        root = os.path.dirname(prefix) or "."
        return [
            (m, os.path.relpath(m, root))
            for m in matches
            if (kind_of(m) or is_hf_folder(Path(m))) and not _inside(m, exclude)
        ]
    path = Path(value)
    if not path.exists():
        raise InputError(f"input {value} does not exist")
    if path.is_file():
        return [(str(path), path.name)]
    if is_hf_folder(path):
        return [(str(path), path.name)]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        if exclude is not None and Path(dirpath).resolve() == exclude:
            dirnames[:] = []
            continue
        for d in list(dirnames):
            if is_hf_folder(Path(dirpath) / d):
                found.append((os.path.join(dirpath, d), os.path.relpath(os.path.join(dirpath, d), path)))
                dirnames.remove(d)
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            if kind_of(f):
                found.append((full, os.path.relpath(full, path)))
    found = [(f, rel) for f, rel in found if not _hidden(rel) and not _inside(f, exclude)]
    return sorted(found, key=lambda x: x[1])


def discover(inputs: list[str], exclude: Path | None = None) -> list[Source]:
    """Expand ``inputs`` in order into sources; files under ``exclude`` (the output folder) are left out."""
    if not inputs:
        raise InputError("no --input given")
    exclude = exclude.resolve() if exclude is not None else None
    sources: list[Source] = []
    for value in inputs:
        if not value.strip():
            raise InputError("--input is empty (an unset shell variable?): give a file, folder or glob")
        remote = "://" in value and not value.startswith("file://")
        found = _expand_remote(value) if remote else _expand_local(value, exclude)
        if not found:
            raise InputError(f"input {value} matches no Parquet, JSONL or saved dataset files")
        for path, name in found:
            if remote:
                kind = kind_of(path)
            else:
                kind = "hf" if Path(path).is_dir() and is_hf_folder(Path(path)) else kind_of(path)
            if kind is None:
                raise InputError(
                    f"input {path}: unsupported format (expected .parquet, .jsonl, .jsonl.gz, .jsonl.zst "
                    "or a datasets.save_to_disk folder)"
                )
            sources.append(Source(path=path, name=name, kind=kind))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        # Same relative name under two --input values: prefix with the value's position to keep ids unique.
        sources = [Source(s.path, f"{i}/{s.name}", s.kind) for i, s in enumerate(sources)]
    # A new job's file i starts at ordinal i << 40; a job's saved records may order them otherwise.
    return [Source(s.path, s.name, s.kind, i << ORDINAL_BITS) for i, s in enumerate(sources)]


def open_binary(source: Source) -> IO[bytes]:
    """A binary stream of a JSONL source, decompressed if it ends with .gz or .zst."""
    low = source.path.lower()
    if source.remote:
        raw: IO[bytes] = _fsspec().open(source.path, "rb").open()
    else:
        raw = open(source.path, "rb")  # noqa: SIM115 - closed by the caller
    if low.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if low.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raw.close()
            raise InputError(f"reading {source.path} needs zstandard: pip install 'batchjob[zstd]'") from e
        import io

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))  # type: ignore[arg-type]
    return raw


def count_rows(source: Source) -> int | None:
    """The number of rows when it is cheap to know (Parquet metadata, small JSONL files), else None."""
    try:
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            if source.remote:
                with _fsspec().open(source.path, "rb") as f:
                    return pq.ParquetFile(f).metadata.num_rows
            return pq.ParquetFile(source.path).metadata.num_rows
        if source.kind == "hf":
            from batchjob.io.readers import load_hf

            return sum(len(ds) for _, ds in load_hf(source))
        if source.remote or not source.path.endswith((".jsonl", ".ndjson")):
            return None
        if os.path.getsize(source.path) > _COUNT_LIMIT_BYTES:
            return None
        with open(source.path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except Exception:  # a broken file is reported by the reader, as rows with errors
        return None
