"""Streaming rows out of sources, one bounded batch at a time; the dataset is never held in memory.

Every row gets an ``ordinal`` (its source's base plus its index: the same on every run) and a derived id
``"<source name>:<row index>"``. A line that is not valid UTF-8 or not a JSON object, an object that gives a
key twice (JSON would keep the last value without a word) or escapes half a UTF-16 pair (no character: no
UTF-8 file can hold it), or a file that stops being readable part-way, becomes a ``Row`` with ``error`` set
(naming the file and line): bad data never stops the stream. A Parquet file is read a row group at a time:
a damaged group's rows (as many as the file's footer gives it) are error rows, and the next group is read.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import pyarrow as pa

from batchjob import faults
from batchjob.errors import BatchjobError, InputError
from batchjob.io.fits import Fit
from batchjob.io.jsontext import parse_line
from batchjob.io.schema import parquet_file, strip_bom, table_schema
from batchjob.io.sources import Source, load_hf, open_binary
from batchjob.io.values import batch_values
from batchjob.io.watch import check_unchanged, stamp

_PARQUET_BATCH_ROWS = 1024


@dataclass
class Row:
    ordinal: int  # source.base + index: its place in the whole input stream (batchjob.job.inputs)
    source: str  # Source.name
    index: int  # row index inside its source
    values: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None
    line: int | None = None  # 1-based line number (JSONL)
    unread: bool = False  # the error row of the rest of its file, which could not be read

    @property
    def derived_id(self) -> str:
        return f"{self.source}:{self.index}"

    @property
    def place(self) -> str:
        """Where the row is, as a message names it: ``in.jsonl line 3``, ``data.parquet row 2``."""
        return (
            f"{self.source} line {self.line}" if self.line is not None else f"{self.source} row {self.index}"
        )


UNREAD = "cannot read the rest of the file"  # a read that failed past a file's start: one error row for it


class Unread(str):
    """The error of a file's unreadable rest (one row): told apart by its type, not by its words."""


class UnreadRestError(InputError):
    """The rest of a file could not be read where its error row would lose rows: in a worker of several
    (another worker's share may hold the row for it, and this one's rows past it would go unread while it
    says complete), or at a row an earlier run read (the rows it read past it are the job's too)."""

    def __init__(self, error: str, earlier: bool = False) -> None:
        if earlier:
            why = (
                "an earlier run of the job read this file past there, so its rest is not lost to a passing "
                "read error: the run stops; run it again to read on (where a batchjob before 2026-12-07 wrote "
                "this row as the file's unreadable rest, --retry-errors reads it again)"
            )
        else:
            why = "this worker stops (its rows past there are unread); run it again to read on"
        super().__init__(f"{error}: {why}")


ReadPast = Callable[[Source, int], bool]  # whether an earlier run of the job read a file past its row i


def _check_unread(
    error: str, source: Source, index: int, stop_unread: bool, read_past: ReadPast | None
) -> None:
    """Raise where the unreadable rest of ``source`` from its row ``index`` would be one error row that
    loses rows: in a worker of several (``stop_unread``), or where an earlier run read past there."""
    if stop_unread:
        raise UnreadRestError(error)
    if read_past is not None and read_past(source, index):
        raise UnreadRestError(error, earlier=True)


def _lines(f: IO[bytes], size: int | None) -> Iterator[bytes]:
    """The lines of ``f``'s first ``size`` bytes (None: all); a line cut at ``size`` ends without newline."""
    if size is None:
        yield from f
        return
    left = size
    while left > 0:
        raw = f.readline(left)
        if not raw:
            return
        left -= len(raw)
        yield raw


def _jsonl_rows(source: Source) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, object or None, error or None) for each non-blank line, and last, where the file
    stops being readable, (line number, None, ``Unread`` error) for its rest."""
    lineno = 0
    fail_at = faults.read_error_line(source.name)
    try:
        with open_binary(source) as f:
            for raw in _lines(f, source.size):
                if lineno + 1 == fail_at:  # as if reading this line failed
                    raise OSError(errno.EIO, "Input/output error (fault injected)")
                lineno += 1
                raw = strip_bom(raw, lineno)
                if not raw.strip():
                    continue
                where = f"{source.name} line {lineno}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    # the line's error row keeps the --id-column value when it reads cleanly (iter_rows)
                    obj, _ = parse_line(raw.decode("utf-8", "replace"))
                    yield lineno, obj, f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})"
                    continue
                obj, error = parse_line(text)
                yield lineno, obj, None if error is None else f"{where}: {error}"
    except Exception as e:  # noqa: BLE001 - a truncated .gz, a corrupt .zst (its own ZstdError), a vanished file
        yield lineno + 1, None, Unread(f"{source.name} line {lineno + 1}: {UNREAD} ({e})")  # then the next


class _Unread(NamedTuple):
    """Rows a damaged part of a file holds, which can't be read: each is an error row saying why."""

    rows: int
    why: str


def _batches(source: Source) -> Iterator[pa.RecordBatch | _Unread]:
    if source.kind != "parquet":
        for _, ds in load_hf(source):
            yield from ds.with_format("arrow").iter(batch_size=_PARQUET_BATCH_ROWS)
        return
    # Row group by row group: one damaged group's rows are error rows, and the next group is read.
    file = parquet_file(source)
    for group in range(file.num_row_groups):
        rows, read = file.metadata.row_group(group).num_rows, 0
        try:
            for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
                read += batch.num_rows
                yield batch
        except Exception as e:  # noqa: BLE001 - whatever the decoder raises, the group's rows take it
            why = " ".join(str(e).split())  # the decoder's message may run over lines
            yield _Unread(
                rows - read, f"cannot read its row group, #{group + 1} of {file.num_row_groups} ({why})"
            )


def _id_only(obj: dict[str, Any], id_column: str | None) -> dict[str, Any] | None:
    """Of a line that failed but parsed once decoded leniently (invalid UTF-8), only its ``id_column`` value,
    and only when no replaced byte is in it: the error row can then say whose row it is, and no other value
    of it (which would hold replacement characters) is written as if read."""
    if id_column is None:
        return None
    value = obj.get(id_column)
    if value is None or "\ufffd" in json.dumps(value, ensure_ascii=False):
        return None
    return {id_column: value}


IdHook = Callable[[int, Any], None]  # (ordinal, id value) of a row the reader passes over


def _table_rows(
    source: Source,
    skip: Callable[[int], bool],
    covered: Callable[[int, int], bool],
    on_skipped: IdHook | None,
    id_column: str | None,
    fit: Fit | None,
    stop_unread: bool,
    read_past: ReadPast | None,
) -> Generator[Row, None, int]:
    """Rows of a Parquet file or saved dataset; returns how many rows (ordinals) the source took."""
    start, index = source.base, 0
    shortcut = fit is None or not fit.checks  # a batch passed over unread: no value of it needs a check
    try:
        for batch in _batches(source):
            if isinstance(batch, _Unread):
                for _ in range(batch.rows):
                    if not skip(start + index):
                        yield Row(
                            start + index, source.name, index, None, f"{source.name} row {index}: {batch.why}"
                        )
                    elif on_skipped is not None:
                        on_skipped(start + index, None)
                    index += 1
                continue
            n = batch.num_rows
            if shortcut and covered(start + index, start + index + n):
                # the whole batch is passed over: don't convert it, but report its ids if asked (a row that
                # can't convert is an error row, which takes no id, as below)
                if on_skipped is not None:
                    named = id_column if id_column in batch.schema.names else None
                    for j, (values, _) in enumerate(batch_values(batch) if named else [(None, "")] * n):
                        on_skipped(start + index + j, None if values is None or not named else values[named])
                index += n
                continue
            for j, (values, error) in enumerate(batch_values(batch)):
                where = f"{source.name} row {index}: "
                failed = where + error if values is None else None
                if values is None and id_column in batch.schema.names:  # the error row says whose it is
                    values, _ = next(batch_values(batch.select([id_column]).slice(j, 1)))
                elif fit is not None and values is not None and (why := fit.why(values)) is not None:
                    failed, values = where + why, fit.kept(values)
                if not skip(start + index):
                    yield Row(start + index, source.name, index, values, failed)
                elif on_skipped is not None:  # an error row takes no id
                    value = values.get(id_column) if values is not None and id_column and not failed else None
                    on_skipped(start + index, value)
                index += 1
    except BatchjobError:  # the input's own refusals, and the id index's (a full disk)
        raise
    except Exception as e:
        # the unreadable rest of the file takes one row (and one ordinal), whether or not it is skipped
        error = f"{source.name} row {index}: {UNREAD} ({e})"
        _check_unread(error, source, index, stop_unread, read_past)
        if not skip(start + index):
            yield Row(start + index, source.name, index, None, error, unread=True)
        index += 1
    return index


def _fit(source: Source, schema: pa.Schema | None) -> Fit | None:
    """The check of ``source``'s rows against the job's ``schema`` (None: no check)."""
    if schema is None:
        return None
    if source.kind == "jsonl":
        return Fit(schema, None)
    try:
        return Fit(schema, table_schema(source))
    except Exception:  # noqa: BLE001 - an unreadable file's rows are its error rows (_table_rows)
        return None


def iter_rows(
    sources: list[Source],
    skip: Callable[[int], bool] = lambda _: False,
    covered: Callable[[int, int], bool] = lambda a, b: False,
    on_skipped: IdHook | None = None,
    id_column: str | None = None,
    schema: pa.Schema | None = None,
    stop_unread: bool = False,
    read_past: ReadPast | None = None,
) -> Generator[Row, None, list[int]]:
    """All rows of ``sources`` in order, leaving out ordinals for which ``skip`` is true; returns the number
    of rows of each source.

    Row ``i`` of a source has the ordinal ``source.base + i``. ``covered(a, b)`` says all of ordinals
    ``[a, b)`` are to be skipped, so a reader can pass over a whole batch without decoding it.
    ``on_skipped(ordinal, value)`` is called for every row left out, with its ``id_column`` value (so that
    ids can be checked job-wide without yielding every row).

    A local file that changes while it is read (``batchjob.io.watch``) stops the reader at its end with an
    InputChangedWhileReadError naming it. With the job's ``schema``, a row holding a value its column can't
    store unchanged is an error row (``batchjob.io.fits``). A file whose rest can't be read is one error row,
    or an ``UnreadRestError`` with ``stop_unread`` (a worker of several) and where ``read_past`` says an
    earlier run read that file past there (a resumed job: its rows past there are not lost to a passing error).
    """
    counts = []
    for source in sources:
        before, fit = stamp(source), _fit(source, schema)
        if source.kind == "jsonl":
            index = 0
            for i, (lineno, obj, error) in enumerate(_jsonl_rows(source)):
                if error is not None and obj is not None:
                    obj = _id_only(obj, id_column)
                elif obj is not None and fit is not None and (why := fit.why(obj)) is not None:
                    error, obj = f"{source.name} line {lineno}: {why}", fit.kept(obj)
                elif isinstance(error, Unread):
                    _check_unread(error, source, i, stop_unread, read_past)
                if not skip(source.base + i):
                    yield Row(source.base + i, source.name, i, obj, error, lineno, isinstance(error, Unread))
                elif on_skipped is not None:
                    # an error row's id (kept for its row) was never taken, as on the first run
                    value = None
                    if obj is not None and error is None and id_column is not None:
                        value = obj.get(id_column)
                    on_skipped(source.base + i, value)
                index = i + 1
        else:
            reader = _table_rows(source, skip, covered, on_skipped, id_column, fit, stop_unread, read_past)
            index = yield from reader
        check_unchanged(source, before)
        counts.append(index)
    return counts
