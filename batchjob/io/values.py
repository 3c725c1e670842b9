"""Arrow record batches as Python row values: a value one row can't convert (a date beyond Python's, a
time64[ns] whose nanoseconds a Python time would drop, in a column of its own or nested in a struct, list or
map) is that row's error, not the rest of the file's."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


def batch_values(batch: pa.RecordBatch) -> Iterator[tuple[dict[str, Any] | None, str]]:
    """Each row of ``batch`` as Python values, or None and why it can't be (a date beyond Python's, say):
    a value one row can't convert is that row's error, not the rest of the file's."""
    lost = _lost_nanoseconds(batch)
    try:
        rows = batch.to_pylist()
    except Exception:  # noqa: BLE001 - row by row, to find the rows at fault
        for j in range(batch.num_rows):
            if j in lost:
                yield None, lost[j]
                continue
            try:
                yield batch.slice(j, 1).to_pylist()[0], ""
            except Exception as e:  # noqa: BLE001
                yield None, f"cannot convert its values ({type(e).__name__}: {e})"
        return
    for j, values in enumerate(rows):
        yield (None, lost[j]) if j in lost else (values, "")


def _lost_nanoseconds(batch: pa.RecordBatch) -> dict[int, str]:
    """The rows holding a time64[ns] value (a column's own, or one nested in a struct, list or map) whose
    nanoseconds a Python time (microseconds) would drop: why each is an error row (timestamps and durations
    keep them, as pandas values)."""
    lost: dict[int, str] = {}
    for field, column in zip(batch.schema, batch.columns, strict=True):
        if not _holds_time_ns(field.type):
            continue
        nested = field.type != pa.time64("ns")
        where = " in a nested value" if nested else ""
        how = (
            "its time64[ns] fields to time64[us], or the column to text"
            if nested
            else "the column to time64[us] or to text"
        )
        for j, ns in sorted(_rows_losing(column).items()):
            lost.setdefault(
                j,
                f"column {field.name!r} holds a time of {ns} ns after midnight{where}, whose nanoseconds "
                f"batchjob would write back as microseconds; cast {how}",
            )
    return lost


def _holds_time_ns(type_: pa.DataType) -> bool:
    """Whether a column of ``type_`` holds time64[ns] values, itself or nested at any depth."""
    if type_ == pa.time64("ns"):
        return True
    if pa.types.is_dictionary(type_):
        return _holds_time_ns(type_.value_type)
    return any(_holds_time_ns(type_.field(i).type) for i in range(type_.num_fields))


def _rows_losing(array: pa.Array) -> dict[int, int]:
    """``{row: nanoseconds}``: the rows of ``array`` whose value is, or holds, a time64[ns] value with
    nanoseconds (the first found of each row); a null row, or a null list's unused values, loses nothing."""
    type_ = array.type
    if type_ == pa.time64("ns"):
        ns = array.cast(pa.int64())
        bad = pc.fill_null(pc.not_equal(pc.multiply(pc.divide(ns, 1000), 1000), ns), False)
        return {j: ns[j].as_py() for j in pc.indices_nonzero(bad).to_pylist()}
    if pa.types.is_struct(type_):
        found: dict[int, int] = {}
        for child in array.flatten():  # the struct's nulls made its fields' nulls
            for j, ns in _rows_losing(child).items():
                found.setdefault(j, ns)
        return found
    if pa.types.is_dictionary(type_):
        bad = _rows_losing(array.dictionary)
        indices = array.indices.to_pylist()
        return {j: bad[k] for j, k in enumerate(indices) if k is not None and k in bad}
    if pa.types.is_fixed_size_list(type_):
        size = type_.list_size
        values = array.values.slice(array.offset * size, len(array) * size)

        def parent(k: int) -> int:
            return k // size

    elif pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_map(type_):
        offsets = array.offsets.to_pylist()
        values = array.values.slice(offsets[0], offsets[-1] - offsets[0])

        def parent(k: int) -> int:
            return bisect.bisect_right(offsets, offsets[0] + k) - 1

    else:
        return {}
    found = {}
    for k, ns in _rows_losing(values).items():
        if array[parent(k)].is_valid:  # a null list's unused values are no row's
            found.setdefault(parent(k), ns)
    return found
