"""Streaming rows out of sources, one bounded batch at a time; the dataset is never held in memory.

Every row gets an ``ordinal`` (its source's base plus its index: the same on every run) and a derived id
``"<source name>:<row index>"``. A line that is not valid UTF-8 or not a JSON object, an object that gives a
key twice (JSON would keep the last value without a word) or escapes half a UTF-16 pair (no character: no
UTF-8 file can hold it), or a file that stops being readable part-way, becomes a ``Row`` with ``error`` set
(naming the file and line): bad data never stops the stream. A Parquet file is read a row group at a time:
a damaged group's rows (as many as the file's footer gives it) are error rows, and the next group is read.
"""

from __future__ import annotations

import codecs
import errno
import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import pyarrow as pa

from batchjob import faults
from batchjob.errors import InputError
from batchjob.io.fits import Fit
from batchjob.io.jsontext import parse_line
from batchjob.io.sources import Source, _fsspec, load_hf, open_binary
from batchjob.io.values import batch_values
from batchjob.io.watch import check_unchanged, stamp

_PARQUET_BATCH_ROWS = 1024
_SCHEMA_SAMPLE_ROWS = 1000


@dataclass
class Row:
    ordinal: int  # source.base + index: its place in the whole input stream (batchjob.job.inputs)
    source: str  # Source.name
    index: int  # row index inside its source
    values: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None
    line: int | None = None  # 1-based line number (JSONL)

    @property
    def derived_id(self) -> str:
        return f"{self.source}:{self.index}"

    @property
    def place(self) -> str:
        """Where the row is, as a message names it: ``in.jsonl line 3``, ``data.parquet row 2``."""
        return (
            f"{self.source} line {self.line}" if self.line is not None else f"{self.source} row {self.index}"
        )


def _parquet_file(source: Source) -> Any:
    import pyarrow.parquet as pq

    if source.remote:
        return pq.ParquetFile(_fsspec().open(source.path, "rb").open())
    return pq.ParquetFile(source.path)


def _json_type(kinds: set[type]) -> pa.DataType:
    kinds = kinds - {type(None)}
    if not kinds:
        return pa.null()
    if kinds == {bool}:
        return pa.bool_()
    if kinds == {int}:
        return pa.int64()
    if kinds <= {int, float}:
        return pa.float64()
    # strings, and anything nested or mixed: stored as (JSON) text
    return pa.string()


def _strip_bom(raw: bytes, lineno: int) -> bytes:
    return raw[len(codecs.BOM_UTF8) :] if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else raw


def _jsonl_kinds(source: Source) -> dict[str, set[type]]:
    """The value types of each key over the first 1,000 objects of a JSONL file, keys in order of first sight."""
    columns: dict[str, set[type]] = {}
    n = 0
    with open_binary(source) as f:
        for lineno, raw in enumerate(f, 1):
            if n >= _SCHEMA_SAMPLE_ROWS:
                break
            obj, error = parse_line(_strip_bom(raw, lineno))
            if obj is not None and error is None:  # an error row's keys are no columns
                n += 1
                for k, v in obj.items():
                    columns.setdefault(str(k), set()).add(type(v))
    return columns


UNREAD = "cannot read the rest of the file"  # a read that failed past a file's start: one error row for it


class UnreadRestError(InputError):
    """A worker of several could not read the rest of a file: another worker's share may hold the row for it,
    and this one's rows past it would go unread while it says complete; it stops, and a rerun reads again."""

    def __init__(self, error: str) -> None:
        super().__init__(f"{error}: this worker stops (its rows past there are unread); run it again to read on")


class RepeatedColumnError(InputError):
    """An input file with two columns of one name: its rows can't be read as name -> value, so the job stops
    before work (not an error row, as another unreadable file is)."""


def _table_schema(source: Source) -> pa.Schema:
    if source.kind == "parquet":
        schema = _parquet_file(source).schema_arrow
    else:
        splits = [(split, ds.features.arrow_schema) for split, ds in load_hf(source)]
        schema = splits[0][1]
        other = next(((split, s) for split, s in splits[1:] if not s.equals(schema)), None)
        if other is not None:  # the rows of one would be read into the other's columns
            raise InputError(
                f"input {source.path}: its splits {splits[0][0]!r} and {other[0]!r} have different columns "
                f"or types ({_columns(schema)}; {_columns(other[1])}); give one split's folder as the input, "
                f"e.g. {source.path}/{other[0]}"
            )
    repeated = sorted({n for n in schema.names if schema.names.count(n) > 1})
    if repeated:
        raise RepeatedColumnError(
            f"input {source.path} has more than one column named {', '.join(map(repr, repeated))}: a row "
            "can't hold two values under one name. Rename them in the file, or leave the file out"
        )
    return schema


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _read_failed(source: Source, e: Exception) -> InputError:
    return InputError(f"cannot read input {source.path}: {e}")


def _unify(schemas: list[tuple[str, pa.Schema]]) -> pa.Schema:
    """One schema over named schemas (integers widen, nulls take the other type); a real conflict is an
    InputError naming the column, two files and their types."""
    try:
        return pa.unify_schemas([s for _, s in schemas], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    first: dict[str, tuple[str, pa.DataType]] = {}
    for name, schema in schemas:
        for f in schema:
            if f.name not in first:
                first[f.name] = (name, f.type)
                continue
            other, type_ = first[f.name]
            try:
                pa.unify_schemas(
                    [pa.schema([pa.field(f.name, type_)]), pa.schema([f])], promote_options="permissive"
                )
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                raise InputError(
                    f"column {f.name!r} is {type_} in {other} but {f.type} in {name}: the inputs of one job "
                    "must agree on each column's type"
                ) from None
    raise InputError(f"the inputs' schemas cannot be combined: {', '.join(n for n, _ in schemas)}")


def source_schema(source: Source) -> pa.Schema:
    """The columns of one source (JSONL: inferred from its first 1,000 rows, see ``input_schema``)."""
    return input_schema([source])


def _jsonl_schema(sources: list[Source], kinds: dict[str, set[type]]) -> tuple[str, pa.Schema]:
    """The JSONL inputs' columns from the value types seen of each key, named for ``_unify``'s messages."""
    text = pa.schema(
        [
            pa.field(k, _json_type(v), metadata=TEXT_ONLY if v - {type(None)} == {str} else None)
            for k, v in kinds.items()
        ]
    )
    jsonl_name = (
        "the JSONL inputs"
        if sum(s.kind == "jsonl" for s in sources) > 1
        else next(s.path for s in sources if s.kind == "jsonl")
    )
    return jsonl_name, text


def input_schema(sources: list[Source]) -> pa.Schema:
    """The input columns of a job: the union of its sources' columns, in order of first appearance.

    Parquet and saved datasets: their own schema (integer columns widen across files; a type conflict is an
    InputError). JSONL: the keys of the first 1,000 rows of each file; a column of booleans, integers or
    numbers keeps that type, anything else (strings, nested values, mixed types) is stored as text, nested
    values as JSON. An empty JSONL file adds nothing (a Parquet file without rows still has its schema).
    """
    kinds: dict[str, set[type]] = {}
    named: list[tuple[str, pa.Schema]] = []
    jsonl_at: int | None = None  # where the JSONL columns sit among the table schemas
    failed: list[InputError] = []
    for source in sources:
        try:
            if source.kind == "jsonl":
                for k, v in _jsonl_kinds(source).items():
                    kinds.setdefault(k, set()).update(v)
                if jsonl_at is None:
                    jsonl_at = len(named)
            else:
                table = _table_schema(source)
                named.append(
                    (source.path, pa.schema([_mark_text(f) for f in table], metadata=table.metadata))
                )
        except RepeatedColumnError:
            raise
        except InputError as e:
            failed.append(e)
        except Exception as e:
            failed.append(_read_failed(source, e))
    if failed and len(failed) == len(sources):
        raise failed[0]  # nothing readable at all; otherwise an unreadable file becomes an error row
    if kinds:
        named.insert(jsonl_at or 0, _jsonl_schema(sources, kinds))
    if not named:
        return pa.schema([])
    schema = _unify(named) if len(named) > 1 else named[0][1]
    # text only where every input that has the column says so
    text = {f.name for f in schema} - {f.name for _, s in named for f in s if not is_text_only(f)}
    # a column that is null everywhere we looked is kept as text (of unknown content)
    return pa.schema(
        [
            pa.field(f.name, pa.string())
            if pa.types.is_null(f.type)
            else _mark_text(f)
            if f.name in text
            else f.remove_metadata()
            for f in schema
        ],
        metadata=schema.metadata,
    )


TEXT_ONLY = {b"batchjob": b"text"}  # field metadata: the column holds text (not JSON text of nested values)


def _mark_text(f: pa.Field) -> pa.Field:
    t = f.type.value_type if pa.types.is_dictionary(f.type) else f.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return f.with_metadata(TEXT_ONLY)
    return f


def is_text_only(f: pa.Field) -> bool:
    """Whether a column of the job's input schema is known to hold only text: a string column of a Parquet
    file or dataset, a JSONL key whose values (in the rows the schema was inferred from) were all strings.
    A JSONL key with nested or mixed values is stored as (JSON) text too, but its rows hold the values."""
    return (f.metadata or {}).get(b"batchjob") == b"text"


def compatible(saved: pa.Schema, source: Source) -> str | None:
    """Why a file added to a job (``--append``) does not fit the job's columns, or None when it does."""
    schema = source_schema(source)
    names = set(saved.names)
    for f in schema:
        if f.name not in names:
            return f"column {f.name!r} is new (the job's columns: {', '.join(saved.names)})"
        want = saved.field(f.name).type
        if pa.types.is_string(want) or pa.types.is_large_string(want) or f.type == want:
            continue
        try:
            merged = pa.unify_schemas(
                [pa.schema([pa.field(f.name, want)]), pa.schema([f])], promote_options="permissive"
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            merged = None
        if merged is None or merged.field(f.name).type != want:
            return f"column {f.name!r} is {f.type} here but {want} in the job"
    return None


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
    """(line number, object or None, error or None) for each non-blank line."""
    lineno = 0
    fail_at = faults.read_error_line(source.name)
    try:
        with open_binary(source) as f:
            for raw in _lines(f, source.size):
                if lineno + 1 == fail_at:  # as if reading this line failed
                    raise OSError(errno.EIO, "Input/output error (fault injected)")
                lineno += 1
                raw = _strip_bom(raw, lineno)
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
        yield lineno + 1, None, f"{source.name} line {lineno + 1}: {UNREAD} ({e})"  # then the next source


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
    file = _parquet_file(source)
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
                # the whole batch is passed over: don't convert it, but report its ids if asked
                if on_skipped is not None:
                    column = batch.schema.get_field_index(id_column) if id_column else -1
                    ids = batch.column(column).to_pylist() if column >= 0 else [None] * n
                    for j, value in enumerate(ids):
                        on_skipped(start + index + j, value)
                index += n
                continue
            for values, error in batch_values(batch):
                where = f"{source.name} row {index}: "
                failed = where + error if values is None else None
                if values is not None and fit is not None and (why := fit.why(values)) is not None:
                    failed, values = where + why, fit.kept(values)
                if not skip(start + index):
                    yield Row(start + index, source.name, index, values, failed)
                elif on_skipped is not None:  # an error row takes no id
                    value = values.get(id_column) if values is not None and id_column and not failed else None
                    on_skipped(start + index, value)
                index += 1
    except InputError:
        raise
    except Exception as e:
        # the unreadable rest of the file takes one row (and one ordinal), whether or not it is skipped
        error = f"{source.name} row {index}: {UNREAD} ({e})"
        if stop_unread:
            raise UnreadRestError(error) from e
        if not skip(start + index):
            yield Row(start + index, source.name, index, None, error)
        index += 1
    return index


def _fit(source: Source, schema: pa.Schema | None) -> Fit | None:
    """The check of ``source``'s rows against the job's ``schema`` (None: no check)."""
    if schema is None:
        return None
    if source.kind == "jsonl":
        return Fit(schema, None)
    try:
        return Fit(schema, _table_schema(source))
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
    or with ``stop_unread`` (a worker of several) an ``UnreadRestError``.
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
                elif stop_unread and obj is None and error is not None and UNREAD in error:
                    raise UnreadRestError(error)
                if not skip(source.base + i):
                    yield Row(source.base + i, source.name, i, obj, error, lineno)
                elif on_skipped is not None:
                    # an error row's id (kept for its row) was never taken, as on the first run
                    value = None
                    if obj is not None and error is None and id_column is not None:
                        value = obj.get(id_column)
                    on_skipped(source.base + i, value)
                index = i + 1
        else:
            index = yield from _table_rows(source, skip, covered, on_skipped, id_column, fit, stop_unread)
        check_unchanged(source, before)
        counts.append(index)
    return counts
