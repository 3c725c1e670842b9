"""The job's inputs as they were: a record per input file, and the check that they still are.

Every input a job has read gets a record when the job first sees it: its name (as in derived row ids), a
sequence number, its size, time stamp and content digest (``batchjob.io.identity``), whether a JSONL file ends
with a newline, and its row count once known. The sequence number fixes where the file's rows sit among all
rows: row ``i`` of file ``seq`` has the ordinal ``seq << 40 | i``. So a file added later, or rows appended to a
file, never move the ordinal of a row the job has already seen, and what is done stays done.

Every run checks the inputs as they are now against the records before any work (``reconcile``): a local
file whose size, time stamp, inode and status-change time are all unchanged is the very file that was read,
untouched (nothing can write to a file or rename it without moving its ctime, and a time stamp set back with
``touch -d`` moves it too), and is taken as unchanged; otherwise its digest is computed again (so two files
swapped by name, even with equal sizes and time stamps, are told apart by content). Remote files have no
inode: for them size and time stamp decide. A changed,
removed or new file refuses the run, naming each; with ``append`` a plain JSONL file that only grew (its old
bytes unchanged, ending with a newline) and new files are taken in, and their rows are processed.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from batchjob.errors import InputError
from batchjob.io import identity
from batchjob.io.sources import (
    ORDINAL_BITS,
    Source,
    _fsspec,
    check_distinct,
    count_rows,
    discover,
    is_compressed,
)

INDEX_MASK = (1 << ORDINAL_BITS) - 1


def ordinal(seq: int, index: int) -> int:
    return (seq << ORDINAL_BITS) | index


def split_ordinal(value: int) -> tuple[int, int]:
    """``(file sequence number, row index in the file)``."""
    return value >> ORDINAL_BITS, value & INDEX_MASK


class InputChangedError(InputError):
    """The inputs are not what the job read: a rerun would mix old answers with new rows."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


@dataclass
class InputRecord:
    seq: int  # order of first sight; the file's rows have ordinals seq << 40 | index
    name: str  # Source.name
    kind: str  # "parquet" | "jsonl" | "hf"
    size: int  # bytes (a dataset folder: all its files)
    mtime_ns: int | None
    digest: str
    ends_newline: bool | None = None  # plain JSONL: whether the last byte is a newline
    rows: int | None = None  # once known
    ino: int | None = None  # a local file's inode and status-change time when it was read (identity.py)
    ctime_ns: int | None = None

    @property
    def base(self) -> int:
        return self.seq << ORDINAL_BITS

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InputRecord:
        return cls(**d)


def digest_records(records: Iterable[InputRecord]) -> str:
    """One digest of the inputs' identities (not of their row counts): what "complete" was reached for."""
    body = [(r.seq, r.name, r.size, r.digest) for r in sorted(records, key=lambda r: r.seq)]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:32]


# -- identifying one source ---------------------------------------------------------------------------


def _remote_reader(source: Source) -> tuple[Any, str, dict[str, Any]]:
    fs, _, (path,) = _fsspec().get_fs_token_paths(source.path)
    return fs, path, fs.info(path)


def _remote_mtime(info: dict[str, Any]) -> int | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return int(value * 1e9)
        ts = getattr(value, "timestamp", None)
        if ts is not None:
            return int(ts() * 1e9)
        return int(hashlib.sha256(str(value).encode()).hexdigest()[:12], 16)  # an opaque stamp
    return None


def _identify(source: Source, prefix: int | None = None) -> identity.FileIdentity:
    if source.kind == "hf" and not source.remote:
        files = identity.folder_digest(Path(source.path))
        size = sum(int(v.split(":", 1)[0]) for v in files.values())
        mtime = max((os.stat(Path(source.path) / rel).st_mtime_ns for rel in files), default=None)
        return identity.FileIdentity(size, mtime, "folder:" + identity.combine(files))
    if source.remote:
        fs, path, info = _remote_reader(source)
        size = int(info.get("size") or 0)

        def read_at(offset: int, length: int) -> bytes:
            return bytes(fs.cat_file(path, start=offset, end=offset + length))

        n = size if prefix is None else prefix
        return identity.FileIdentity(size, _remote_mtime(info), identity.digest_of(read_at, n))
    return identity.identify_local(source.path, prefix)


def _stat(source: Source) -> tuple[int, int | None, int | None, int | None] | None:
    """(size, mtime, inode, ctime) when cheap (one file, local or remote: no inode nor ctime); None means
    "compute the digest to know"."""
    if source.kind == "hf":
        return None
    if source.remote:
        _, _, info = _remote_reader(source)
        mtime = _remote_mtime(info)
        return None if mtime is None else (int(info.get("size") or 0), mtime, None, None)
    return identity.stat_local(source.path)


def _ends_newline(source: Source, size: int) -> bool | None:
    """Plain local JSONL: whether rows appended later start on a line of their own (None: not such a file)."""
    if source.kind != "jsonl" or source.remote or is_compressed(source):
        return None
    return size == 0 or identity.byte_at(source.path, size - 1) == b"\n"


def _torn_row(source: Source, size: int) -> int | None:
    """The index of the row on the last line of a plain JSONL file's first ``size`` bytes when that line
    has no newline, else None; rows counted as the reader counts them (non-blank lines, a BOM ignored)."""
    rows, lines, line = 0, 0, b""
    with open(source.path, "rb") as f:
        left = size
        while left > 0:
            raw = f.readline(min(left, 1 << 20))
            if not raw:
                break
            left -= len(raw)
            line += raw
            if line.endswith(b"\n"):
                lines += 1
                rows += bool(_without_bom(line, lines).strip())
                line = b""
    return rows if _without_bom(line, lines + 1).strip() else None


def _without_bom(line: bytes, lineno: int) -> bytes:
    return line[len(codecs.BOM_UTF8) :] if lineno == 1 and line.startswith(codecs.BOM_UTF8) else line


def _unreadable(source: Source, e: Exception) -> InputError:
    return InputError(f"cannot read input {source.path}: {getattr(e, 'strerror', None) or e}")


def record_for(source: Source, seq: int) -> InputRecord:
    """A new record for ``source`` (its row count when cheap to know)."""
    try:
        ident = _identify(source)
        return InputRecord(
            seq,
            source.name,
            source.kind,
            ident.size,
            ident.mtime_ns,
            ident.digest,
            _ends_newline(source, ident.size),
            count_rows(source),
            ident.ino,
            ident.ctime_ns,
        )
    except OSError as e:
        raise _unreadable(source, e) from e


def new_records(sources: list[Source]) -> list[InputRecord]:
    return [record_for(s, i) for i, s in enumerate(sources)]


# -- checking them again ------------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _from_to(before: int, after: int) -> str:
    """``from A to B``, in bytes where the rounded sizes would read the same (137.0 KiB to 137.0 KiB)."""
    a, b = _size(before), _size(after)
    return f"from {a} to {b}" if a != b else f"from {before} to {after} bytes"


# (record now, problem, grew, torn): what one file's check found (``_check_one``)
_Check = tuple[InputRecord | None, str | None, bool, int | None]


def _check_one(source: Source, saved: InputRecord, append: bool) -> _Check:
    """``(record now, problem, grew, torn)`` for one file that the job has a record of; ``torn``: the index
    of its last row when that row's line had no newline and has grown since (``--append`` redoes it)."""
    try:
        stat = _stat(source)
        if stat is not None and stat == (saved.size, saved.mtime_ns, saved.ino, saved.ctime_ns):
            return saved, None, False, None  # the same file, untouched since it was read: unchanged
        if stat is not None and saved.ctime_ns is None and stat[:2] == (saved.size, saved.mtime_ns):
            return saved, None, False, None  # a record without inode and ctime (remote): size and time stamp
        now = _identify(source)
        if now.size == saved.size:
            return _same_size(source, saved, now)
        if now.size < saved.size:
            return None, f"changed (shrank {_from_to(saved.size, now.size)})", False, None
        return _grown(source, saved, now, append)
    except FileNotFoundError:
        return None, "removed", False, None
    except OSError as e:
        raise _unreadable(source, e) from e


def _same_size(source: Source, saved: InputRecord, now: identity.FileIdentity) -> _Check:
    """A file of its recorded size: unchanged (the record takes its new time stamps) unless its content, or
    (a file too large to read whole) its time stamp, says otherwise."""
    if now.digest != saved.digest:
        return None, "changed (same size, different content)", False, None
    if now.sampled and now.mtime_ns != saved.mtime_ns and saved.mtime_ns is not None:
        stamp = f"{saved.mtime_ns // 10**9}.{saved.mtime_ns % 10**9:09d}"
        return (
            None,
            f"modified (its time stamp changed); its size and sampled content are the same, but a file "
            f"over {_size(identity.FULL_BYTES)} is not read whole, so a change elsewhere can't be "
            f"ruled out. If it is unchanged (copied or touched), restore its time stamp: "
            f"touch -d @{stamp} {source.path}",
            False,
            None,
        )
    return (
        replace(saved, mtime_ns=now.mtime_ns, ino=now.ino, ctime_ns=now.ctime_ns),
        None,
        False,
        None,
    )


def _grown(source: Source, saved: InputRecord, now: identity.FileIdentity, append: bool) -> _Check:
    """A file larger than recorded: rows appended to a plain JSONL file (taken in with ``--append``), or a
    change."""
    old = _identify(source, prefix=saved.size)
    if old.digest != saved.digest:
        plain = source.kind == "jsonl" and not is_compressed(source)
        what = "and rows before the end differ" if plain else "and its content differs: rewritten"
        return None, f"changed (grew {_from_to(saved.size, now.size)}, {what})", False, None
    grown = f"grew by {_size(now.size - saved.size)} (rows appended?)"
    if source.kind != "jsonl" or is_compressed(source):
        what = (
            "a Parquet file"
            if source.kind == "parquet"
            else "a compressed file"
            if source.kind == "jsonl"
            else "a saved dataset"
        )
        return None, f"{grown}, but {what} can't be appended to: add new rows as new files", False, None
    torn = None if saved.ends_newline else _torn_row(source, saved.size)
    if not append:
        again = "" if torn is None else f" (and to redo row {torn}, whose line was not finished)"
        return None, f"{grown}: run with --append to process the new rows{again}", True, None
    ends = _ends_newline(source, now.size)
    return (
        replace(
            saved,
            size=now.size,
            mtime_ns=now.mtime_ns,
            digest=now.digest,
            ends_newline=ends,
            rows=None,
            ino=now.ino,
            ctime_ns=now.ctime_ns,
        ),
        None,
        True,
        torn,
    )


def named_as_recorded(saved: list[InputRecord], sources: list[Source]) -> list[Source]:
    """``sources`` named as the job's records name them, where a start names them otherwise now: a name
    two --input values share since a file was added under one (``x.jsonl`` became ``0/x.jsonl``), or a job
    an earlier batchjob named by the files' places in the list (``2/x.jsonl``), which a file added before
    them moves. A record's local file is the source its inode says, among those that can have its name (the
    name after the value's place, after the file's place in the list, or the plain name; by inode, after any
    place, so --input values given in another order find their records); else, in that
    order, the one source that can have it. Two that can (remote files, or a file replaced since) are
    refused, naming both; a source no record names keeps a name no record has (``check_distinct``)."""
    recorded = {r.name: r for r in saved}
    options = [(f"{s.value}/{s.plain}", f"{i}/{s.plain}", s.plain) for i, s in enumerate(sources)]
    names: dict[int, str] = {}  # source index -> the recorded name it takes
    for i, source in enumerate(sources):
        ino = None if source.remote else _inode(source.path)
        placed = [n for n in recorded if _place_and_name(n) == source.plain]
        for name in (*options[i], *placed):  # (any value's place: --input values given in another order)
            rec = recorded.get(name)
            if ino is not None and rec is not None and rec.ino == ino and name not in names.values():
                names[i] = name
                break
    for level in range(3):
        claims: dict[str, list[int]] = {}
        for i in range(len(sources)):
            name = options[i][level]
            if i not in names and name in recorded and name not in names.values():
                claims.setdefault(name, []).append(i)
        for name, claimants in claims.items():
            if len(claimants) > 1:
                paths = ", ".join(sources[i].path for i in claimants)
                raise InputError(
                    f"the job's input file {name!r} can be any of {paths}: give the --input values the job "
                    "started with (or a new --output)"
                )
            names[claimants[0]] = name
    out = []
    for i, s in enumerate(sources):
        name = names.get(i, s.name)
        if i not in names and name in recorded:  # a new file under a name a record has: the value's place
            name = options[i][0]
        out.append(replace(s, name=name))
    check_distinct(out, [s.name for s in out])
    return out


def _place_and_name(name: str) -> str | None:
    """The plain name of a name given after a place (``1/x.jsonl``: ``x.jsonl``), or None."""
    place, _, plain = name.partition("/")
    return plain if place.isdigit() and plain else None


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def reconcile(
    saved: list[InputRecord], sources: list[Source], append: bool, out_dir: Path | str
) -> tuple[list[InputRecord], list[str], list[int]]:
    """Check ``sources`` (the inputs now) against the job's ``saved`` records.

    Returns ``(records, taken, redo)``: the records to run with (grown files and new files taken in when
    ``append``), a line per file taken in, and the ordinals of rows to compute again: a JSONL file's last
    row whose line had no newline when it was read (a log caught mid-write) and was written on since, so
    that its result, made from a torn line, is made again from the whole one. Raises InputChangedError listing every file that changed, was
    removed or is new (unless ``append``), with what to do.
    """
    by_name = {s.name: s for s in sources}
    known = {r.name for r in saved}
    records: list[InputRecord] = []
    problems: list[str] = []
    taken: list[str] = []
    redo: list[int] = []
    for rec in saved:
        source = by_name.get(rec.name)
        if source is None:
            problems.append(f"{rec.name}: removed (or no longer matched by --input)")
            continue
        now, problem, grew, torn = _check_one(source, rec, append)
        if problem is not None:
            problems.append(f"{source.path}: {problem}")
        elif now is not None:
            records.append(now)
            if grew:
                taken.append(_grew_line(source, rec, now, torn))
            if torn is not None:
                redo.append(ordinal(rec.seq, torn))
    new = [s for s in sources if s.name not in known]
    if new and not append:
        problems += [f"{s.path}: new file (run with --append to process it)" for s in new]
    if problems:
        hint = (
            "run with --append to process the new rows (what is done is kept)"
            if only_growth(problems)
            else "restore the inputs the job started with, or give a new --output for the new data"
        )
        raise InputChangedError(
            f"the inputs of the job in {out_dir} changed since it started:\n  "
            + "\n  ".join(problems)
            + f"\nA job's rows must stay what they were, or its results would mix old and new data; {hint}",
            problems,
        )
    if append and new:
        seq = max((r.seq for r in saved), default=-1) + 1
        for s in new:
            records.append(record_for(s, seq))
            taken.append(f"{s.path}: new file; its rows will be processed")
            seq += 1
    return records, taken, redo


def only_growth(problems: list[str]) -> bool:
    """Whether every change ``reconcile`` listed is growth that ``--append`` takes in (each such line says
    to run with --append; a change it refuses even then does not)."""
    return bool(problems) and all("--append" in p for p in problems)


def _grew_line(source: Source, rec: InputRecord, now: InputRecord, torn: int | None) -> str:
    """What --append says of a file it takes in grown."""
    again = "" if torn is None else f", and row {torn} again (its line was not finished)"
    sampled = (
        ""
        if rec.size <= identity.FULL_BYTES
        else f" (its first {_size(rec.size)} were checked in samples, not whole: a row edited in place there "
        "keeps its old result)"
    )
    return f"{source.path}: grew by {_size(now.size - rec.size)}; its new rows will be processed{again}{sampled}"


def ordered_sources(sources: list[Source], records: list[InputRecord]) -> list[Source]:
    """The sources in the order of their records (first sight), each with its ordinal base and, a plain
    JSONL file, the size to read: a line half written after the job recorded the file is not read (it would
    be an error row that ``--append``, going by the record, would not know to redo)."""
    by_name = {s.name: s for s in sources}
    ordered = []
    for r in sorted(records, key=lambda r: r.seq):
        source = by_name[r.name]
        plain = source.kind == "jsonl" and not source.remote and not is_compressed(source)
        ordered.append(replace(source, base=r.base, size=r.size if plain else None))
    return ordered


def changes_now(records: list[InputRecord], paths: list[str], out_dir: Path) -> list[str]:
    """What differs between a job's records and its inputs as they are now, a line per file (for status)."""
    if not paths:
        return []
    try:
        reconcile(records, named_as_recorded(records, discover(paths, exclude=out_dir)), False, out_dir)
    except InputChangedError as e:
        return e.problems
    except InputError as e:
        return [str(e)]
    return []
