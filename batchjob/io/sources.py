"""Turning ``--input`` values (files, folders, globs, remote URLs) into an ordered list of sources.

Each source gets a stable ``name``: its path relative to the folder its ``--input`` value points into, so a
row's derived id (``"reviews.jsonl:17"``) does not depend on where the job runs. The order is sorted and
fixed, which makes the position of every row in the whole stream (its ordinal) the same on every run.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import os
from collections import Counter
from dataclasses import dataclass, replace
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
    # plain JSONL: bytes to read, its size when the job recorded it (what grew since is --append's); None: all
    size: int | None = None
    plain: str = ""  # the name its --input value gives it (``name``: after the value's place, on a clash)
    value: int = 0  # the place (from 0) of the --input value that found it

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


@dataclass(frozen=True)
class Skipped:
    """A path inside an ``--input`` folder or glob that is not an input, and why (``validate`` lists them)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def _matches(parts: tuple[str, ...], pats: tuple[str, ...]) -> bool:
    """Whether a relative path matches glob parts (``**``: any number of folders, ``*``: within a name)."""
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_matches(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and _matches(parts[1:], pats[1:])


def _may_hold(parts: tuple[str, ...], pats: tuple[str, ...]) -> bool:
    """Whether a folder at ``parts`` can hold a path that matches ``pats``."""
    if not parts:
        return bool(pats)
    if not pats:
        return False
    if pats[0] == "**":
        return True
    return fnmatch.fnmatchcase(parts[0], pats[0]) and _may_hold(parts[1:], pats[1:])


def _spelled_out(name: str, pats: tuple[str, ...] | None) -> bool:
    """A name starting with ``.`` or ``_`` is taken only where a glob part asks for it: one that starts with
    the same character and matches it (``_*.jsonl``, ``.cache``)."""
    return pats is not None and any(
        p != "**" and p.startswith(name[0]) and fnmatch.fnmatchcase(name, p) for p in pats
    )


def _walk(
    root: Path, pats: tuple[str, ...] | None, exclude: Path | None, skipped: list[Skipped]
) -> list[tuple[str, str]]:
    """``(path, name)`` of the input files and saved datasets under ``root`` (matching the glob parts
    ``pats`` when given), by the one rule of ``discover``; what it leaves out goes to ``skipped``."""
    found: list[tuple[str, str]] = []

    def visit(folder: Path, rel: tuple[str, ...], above: dict[tuple[int, int], str]) -> None:
        real = folder.resolve()
        if exclude is not None and (real == exclude or exclude in real.parents):
            skipped.append(Skipped(str(folder), "the job's own output folder"))
            return
        try:
            st = folder.stat()
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            skipped.append(Skipped(str(folder), f"cannot be listed ({e.strerror or e})"))
            return
        key = (st.st_dev, st.st_ino)
        if key in above:  # a symbolic link back to a folder it is in: walked once, there
            skipped.append(Skipped(str(folder), f"a symbolic link loop (back to {above[key]})"))
            return
        above = above | {key: str(folder)}
        for entry in entries:
            parts = (*rel, entry.name)
            path = Path(entry.path)
            try:
                is_dir = entry.is_dir()  # follows symbolic links
            except OSError:
                is_dir = False
            if is_dir:
                dataset = is_hf_folder(path)
                wanted = _matches(parts, pats) if dataset and pats is not None else True
                if pats is not None and not (wanted if dataset else _may_hold(parts, pats)):
                    continue  # not asked for by the glob: not a skip
            elif pats is not None and not _matches(parts, pats):
                continue
            name = "/".join(parts)
            if entry.name.startswith((".", "_")) and not _spelled_out(entry.name, pats):
                skipped.append(Skipped(entry.path, f"its name starts with {entry.name[0]!r}"))
            elif is_dir and is_hf_folder(path):
                found.append((entry.path, name))
            elif is_dir:
                visit(path, parts, above)
            elif not path.is_file():
                skipped.append(Skipped(entry.path, "not a regular file (a broken symbolic link?)"))
            elif kind_of(entry.name) is None:
                skipped.append(Skipped(entry.path, "not .parquet, .pq, .jsonl or .ndjson (.gz, .zst)"))
            else:
                found.append((entry.path, name))

    visit(root, (), {})
    return sorted(found, key=lambda x: x[1])


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:
        raise InputError("remote inputs need fsspec: pip install 'batchjob[remote]'") from e
    return fsspec


def _expand_remote(value: str, skipped: list[Skipped]) -> list[tuple[str, str]]:
    """A remote file, folder or glob, by the same rule as a local one (``discover``)."""
    fsspec = _fsspec()
    protocol, rest = value.split("://", 1)
    try:
        fs, _ = fsspec.core.url_to_fs(value)
    except (ImportError, ValueError) as e:
        raise InputError(f"cannot open input {value}: {e} (install the filesystem package for it)") from e
    pats: tuple[str, ...] | None = None
    if glob.has_magic(rest):
        root, pats = _glob_root(rest)
        base = fs._strip_protocol(f"{protocol}://{root}").rstrip("/")
    else:
        base = fs._strip_protocol(value).rstrip("/")
        if not fs.isdir(base):
            return [(value, base.rsplit("/", 1)[-1])] if fs.exists(base) else []
    found: list[tuple[str, str]] = []
    for path in sorted(fs.find(base)):
        rel = path[len(base) :].lstrip("/")
        parts = tuple(rel.split("/"))
        if pats is not None and not _matches(parts, pats):
            continue
        hidden = next((p for p in parts if p.startswith((".", "_")) and not _spelled_out(p, pats)), None)
        if hidden is not None:
            skipped.append(Skipped(f"{protocol}://{path}", f"a name in it starts with {hidden[0]!r}"))
        elif kind_of(path) is None:
            skipped.append(
                Skipped(f"{protocol}://{path}", "not .parquet, .pq, .jsonl or .ndjson (.gz, .zst)")
            )
        else:
            found.append((f"{protocol}://{path}", rel))
    return found


def _glob_root(value: str) -> tuple[str, tuple[str, ...]]:
    """A glob's folder before its first wildcard, and the glob parts after it."""
    parts = value.split(os.sep)
    first = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    root = os.sep.join(parts[:first]) or ("." if not value.startswith(os.sep) else os.sep)
    return root, tuple(p for p in parts[first:] if p)


def takes(value: str, path: Path) -> bool:
    """Whether the local ``--input`` value ``value`` takes the file ``path`` (resolved; it need not exist
    yet), by ``discover``'s rule: so that nothing batchjob writes becomes an input of a job."""
    if "://" in value and not value.startswith("file://"):
        return False
    value = value.removeprefix("file://")
    pats: tuple[str, ...] | None = None
    try:
        if glob.has_magic(value):
            root_name, pats = _glob_root(value)
            root = Path(root_name).resolve()
        else:
            root = Path(value).resolve()
    except (RuntimeError, OSError):  # a symbolic link loop: it takes nothing
        return False
    if pats is None:
        if root == path or (is_hf_folder(root) and root in path.parents):
            return True
        if not root.is_dir():
            return False
    return any(_takes_rel(rel, pats, path.name) for rel in _names_under(root, path))


def _takes_rel(rel: tuple[str, ...], pats: tuple[str, ...] | None, name: str) -> bool:
    """Whether the file at ``rel`` (its path's parts under the --input folder or glob root) is taken."""
    if pats is not None and not _matches(rel, pats):
        return False
    hidden = any(p.startswith((".", "_")) and not _spelled_out(p, pats) for p in rel)
    return not hidden and kind_of(name) is not None


def _names_under(root: Path, path: Path) -> list[tuple[str, ...]]:
    """The relative paths by which the walk of ``root`` (the resolved --input folder) reaches ``path``
    (resolved): directly, and through each symbolic link to a folder outside ``root`` (its real path is
    not under ``root``, but the walk follows the link to it)."""
    names: list[tuple[str, ...]] = []
    if root in path.parents:
        names.append(path.relative_to(root).parts)
    seen = {root}
    todo: list[tuple[Path, tuple[str, ...]]] = [(root, ())]
    while todo:  # the folders the walk visits, each once (a link loop ends)
        folder, rel = todo.pop()
        try:
            entries = [e for e in os.scandir(folder) if e.is_dir()]
        except OSError:
            continue
        for entry in entries:
            try:
                real = Path(entry.path).resolve()
            except (RuntimeError, OSError):
                continue
            parts = (*rel, entry.name)
            if entry.is_symlink() and root not in real.parents and real in (path, *path.parents):
                names.append((*parts, *path.relative_to(real).parts))  # each link's name: one may be hidden
            if real not in seen:
                seen.add(real)
                todo.append((real, parts))
    return names


def _expand_local(value: str, exclude: Path | None, skipped: list[Skipped]) -> list[tuple[str, str]]:
    if value.startswith("file://"):
        value = value[len("file://") :]
    if glob.has_magic(value):
        root, pats = _glob_root(value)
        found = _walk(Path(root), pats, exclude, skipped) if Path(root).is_dir() else []
        matched = [(os.path.normpath(f), name) for f, name in found]
        if not os.path.exists(value):
            return matched
        # a name holding [, ] or *: the path itself, unless as a glob it means other files too
        others = [f for f, _ in matched if f != os.path.normpath(value)]
        if others:
            raise InputError(
                f"input {value} names a file, and read as a glob it matches {others[0]} too: give "
                f"{glob.escape(value)} to read that file alone"
            )
    path = Path(value)
    if not path.exists():
        raise InputError(f"input {value} does not exist")
    if path.is_file() or is_hf_folder(path):
        return [(str(path), path.name)]  # named as is: taken whatever its name
    return _walk(path, None, exclude, skipped)


def discover(
    inputs: list[str], exclude: Path | None = None, skipped: list[Skipped] | None = None
) -> list[Source]:
    """Expand ``inputs`` in order into sources, by one rule for folders and globs alike:

    - a folder is searched through all its subfolders, following symbolic links (a link back to a folder
      it is in is not followed: the loop ends); a glob matches the paths under the folder before its first wildcard the same
      way (``**`` any number of folders);
    - a file or folder whose name starts with ``.`` or ``_`` (hidden and temporary files, ``_SUCCESS``, a
      job's ``_batchjob``) is left out unless named: given as the path itself, or by a glob part that starts
      with that character (``data/_*.jsonl``);
    - files other than .parquet/.pq/.jsonl/.ndjson (plain, .gz, .zst) and the job's output folder
      (``exclude``) are left out; a ``datasets.save_to_disk`` folder is one input.

    What a folder or glob leaves out is appended to ``skipped`` with the reason.
    """
    skipped = [] if skipped is None else skipped
    try:
        exclude = exclude.resolve() if exclude is not None else None
    except (RuntimeError, OSError) as e:  # a symbolic link loop
        raise InputError(f"--output {exclude} cannot be resolved ({e})") from e
    if not inputs:
        raise InputError("no --input given")
    sources: list[Source] = []
    for place, value in enumerate(inputs):
        if not value.strip():
            raise InputError("--input is empty (an unset shell variable?): give a file, folder or glob")
        remote = "://" in value and not value.startswith("file://")
        left_out: list[Skipped] = []
        found = _expand_remote(value, left_out) if remote else _expand_local(value, exclude, left_out)
        skipped += left_out
        if not found:
            why = "".join(f"\n  skipped {s}" for s in left_out[:10])
            more = f"\n  and {len(left_out) - 10} more" if len(left_out) > 10 else ""
            raise InputError(f"input {value} matches no Parquet, JSONL or saved dataset files{why}{more}")
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
            sources.append(Source(path=path, name=name, kind=kind, plain=name, value=place))
    sources = _read_once(sources, skipped)
    # A new job's file i starts at ordinal i << 40; a job's saved records may order them otherwise.
    return [
        replace(s, name=n, base=i << ORDINAL_BITS)
        for i, (s, n) in enumerate(zip(sources, job_names(sources), strict=True))
    ]


def job_names(sources: list[Source]) -> list[str]:
    """Each source's name in a new job (its records, derived row ids): the name its --input value gives it,
    or where two values give one name (``--input a/x.jsonl --input b/x.jsonl``), that name after the value's
    place (``0/x.jsonl``, ``1/x.jsonl``), so that a file found later under one value leaves the others'
    names as they were. (Before, every name took the file's place in the list on a clash: a file added
    before the others moved all of them, and the job refused to resume, its files "removed".)"""
    count = Counter(s.plain for s in sources)
    names = [s.plain if count[s.plain] == 1 else f"{s.value}/{s.plain}" for s in sources]
    check_distinct(sources, names)
    return names


def check_distinct(sources: list[Source], names: list[str]) -> None:
    """Refuse two files under one name (one record, one set of derived row ids: rows lost or mixed),
    naming both."""
    first: dict[str, Source] = {}
    for source, name in zip(sources, names, strict=True):
        if name in first:
            raise InputError(
                f"input files {first[name].path} and {source.path} would both be named {name!r} in the job "
                "(its records and derived row ids), which can't tell them apart: rename one, or give them "
                "under --input values that name them apart"
            )
        first[name] = source


def _read_once(sources: list[Source], skipped: list[Skipped]) -> list[Source]:
    """Each local file (or saved dataset) once, by its real path: a symbolic link inside an input folder to a
    sibling folder, or two --input values naming one file, would otherwise read its rows twice, as two rows
    each. The name that reaches it without a symbolic link reads it (else the first, in discovery order); the
    others go to ``skipped``, saying which it is."""
    reader: dict[str, Source] = {}
    for source in sources:
        real = source.path if source.remote else os.path.realpath(source.path)
        if real not in reader or (os.path.abspath(source.path) == real != os.path.abspath(reader[real].path)):
            reader[real] = source
    kept: list[Source] = []
    for source in sources:
        chosen = reader[source.path if source.remote else os.path.realpath(source.path)]
        if chosen is source:
            kept.append(source)
        else:
            skipped.append(Skipped(source.path, f"the same file as {chosen.path} (read once, as that)"))
    return kept


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


def load_hf(source: Source) -> list[tuple[str, Any]]:
    """The (split name, memory-mapped Dataset) pairs of a ``save_to_disk`` folder."""
    import datasets  # heavy and optional: loaded only when an input is a dataset folder

    try:
        loaded = datasets.load_from_disk(source.path)
    except Exception as e:
        raise InputError(f"cannot load dataset folder {source.path}: {e}") from e
    if isinstance(loaded, datasets.DatasetDict):
        return [(split, loaded[split]) for split in sorted(loaded)]
    return [("", loaded)]


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
            return sum(len(ds) for _, ds in load_hf(source))
        if source.remote or not source.path.endswith((".jsonl", ".ndjson")):
            return None
        if os.path.getsize(source.path) > _COUNT_LIMIT_BYTES:
            return None
        with open(source.path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except Exception:  # a broken file is reported by the reader, as rows with errors
        return None
