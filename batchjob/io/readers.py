"""Streaming rows out of sources, one bounded batch at a time; the dataset is never held in memory.

Every row gets an ``ordinal`` (its position in the whole stream, the same on every run) and a derived id
``"<source name>:<row index>"``. A line that is not valid UTF-8 or not a JSON object, or a file that stops
being readable part-way, becomes a ``Row`` with ``error`` set (naming the file and line): bad data never
stops the stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchjob.errors import InputError
from batchjob.io.sources import Source, _fsspec, open_binary

_PARQUET_BATCH_ROWS = 1024
_SCHEMA_SAMPLE_ROWS = 1000


@dataclass
class Row:
    ordinal: int  # position in the whole input stream
    source: str  # Source.name
    index: int  # row index inside its source
    values: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None
    line: int | None = None  # 1-based line number (JSONL)

    @property
    def derived_id(self) -> str:
        return f"{self.source}:{self.index}"


def load_hf(source: Source) -> list[tuple[str, Any]]:
    """The (split name, memory-mapped Dataset) pairs of a ``save_to_disk`` folder."""
    import datasets

    try:
        loaded = datasets.load_from_disk(source.path)
    except Exception as e:
        raise InputError(f"cannot load dataset folder {source.path}: {e}") from e
    if isinstance(loaded, datasets.DatasetDict):
        return [(split, loaded[split]) for split in sorted(loaded)]
    return [("", loaded)]


def _parquet_file(source: Source) -> Any:
    import pyarrow.parquet as pq

    if source.remote:
        return pq.ParquetFile(_fsspec().open(source.path, "rb").open())
    return pq.ParquetFile(source.path)


def _json_type(values: list[Any]) -> pa.DataType:
    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return pa.string()
    if kinds == {bool}:
        return pa.bool_()
    if kinds == {int}:
        return pa.int64()
    if kinds <= {int, float}:
        return pa.float64()
    # strings, and anything nested or mixed: stored as (JSON) text
    return pa.string()


def input_schema(source: Source) -> pa.Schema:
    """The input columns of a job, fixed from its first source.

    Parquet and saved datasets: their own schema. JSONL: the keys of the first 1,000 rows in order of first
    appearance; a column of booleans, integers or numbers keeps that type, anything else (strings, nested
    values, mixed types) is stored as text, nested values as JSON.
    """
    try:
        if source.kind == "parquet":
            return _parquet_file(source).schema_arrow
        if source.kind == "hf":
            return load_hf(source)[0][1].features.arrow_schema
        columns: dict[str, list[Any]] = {}
        n = 0
        with open_binary(source) as f:
            for raw in f:
                if n >= _SCHEMA_SAMPLE_ROWS:
                    break
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    n += 1
                    for k, v in obj.items():
                        columns.setdefault(str(k), []).append(v)
        return pa.schema([pa.field(k, _json_type(v)) for k, v in columns.items()])
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cannot read input {source.path}: {e}") from e


def _jsonl_rows(source: Source) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, object or None, error or None) for each non-blank line."""
    lineno = 0
    try:
        with open_binary(source) as f:
            for raw in f:
                lineno += 1
                if not raw.strip():
                    continue
                where = f"{source.name} line {lineno}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, None, f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})"
                    continue
                try:
                    obj = json.loads(text)
                except ValueError as e:
                    yield lineno, None, f"{where}: bad JSON ({e})"
                    continue
                if not isinstance(obj, dict):
                    yield lineno, None, f"{where}: not a JSON object (got {type(obj).__name__})"
                    continue
                yield lineno, obj, None
    except (OSError, EOFError, ValueError) as e:
        # a truncated .gz, a corrupt .zst, a file that vanished: one error row, then the next source
        yield lineno + 1, None, f"{source.name} line {lineno + 1}: cannot read the rest of the file ({e})"
    except Exception as e:  # noqa: BLE001 - zstandard raises its own ZstdError
        yield lineno + 1, None, f"{source.name} line {lineno + 1}: cannot read the rest of the file ({e})"


def _batches(source: Source) -> Iterator[pa.RecordBatch]:
    if source.kind == "parquet":
        yield from _parquet_file(source).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
    else:
        for _, ds in load_hf(source):
            yield from ds.with_format("arrow").iter(batch_size=_PARQUET_BATCH_ROWS)


def _table_rows(
    source: Source, start: int, skip: Callable[[int], bool], covered: Callable[[int, int], bool]
) -> Generator[Row, None, int]:
    """Rows of a Parquet file or saved dataset; returns how many ordinals the source took."""
    index = 0
    try:
        for batch in _batches(source):
            n = batch.num_rows
            if covered(start + index, start + index + n):
                index += n  # the whole batch is done already: don't even convert it
                continue
            for values in batch.to_pylist():
                if not skip(start + index):
                    yield Row(start + index, source.name, index, values)
                index += 1
    except InputError:
        raise
    except Exception as e:
        # the unreadable rest of the file takes one row (and one ordinal), whether or not it is skipped
        if not skip(start + index):
            yield Row(
                start + index, source.name, index, None, f"{source.name} row {index}: cannot read ({e})"
            )
        index += 1
    return index


def iter_rows(
    sources: list[Source],
    skip: Callable[[int], bool] = lambda _: False,
    covered: Callable[[int, int], bool] = lambda a, b: False,
) -> Generator[Row, None, int]:
    """All rows of ``sources`` in order, leaving out ordinals for which ``skip`` is true; returns the count.

    ``covered(a, b)`` says all of ordinals ``[a, b)`` are to be skipped, so a reader can pass over a whole
    batch without decoding it.
    """
    start = 0
    for source in sources:
        if source.kind == "jsonl":
            index = 0
            for i, (lineno, obj, error) in enumerate(_jsonl_rows(source)):
                if not skip(start + i):
                    yield Row(start + i, source.name, i, obj, error, lineno)
                index = i + 1
        else:
            index = yield from _table_rows(source, start, skip, covered)
        start += index
    return start
