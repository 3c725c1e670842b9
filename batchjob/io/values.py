"""Arrow record batches as Python row values: a value one row can't convert (a date beyond Python's, a
time64[ns] whose nanoseconds a Python time would drop) is that row's error, not the rest of the file's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa


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
    """The rows of a time64[ns] column whose nanoseconds a Python time (microseconds) would drop: why each
    is an error row (timestamps and durations keep them, as pandas values)."""
    lost: dict[int, str] = {}
    for field, column in zip(batch.schema, batch.columns, strict=True):
        if field.type != pa.time64("ns"):
            continue
        for j, ns in enumerate(column.cast(pa.int64()).to_pylist()):
            if ns is not None and ns % 1000 and j not in lost:
                lost[j] = (
                    f"column {field.name!r} holds a time of {ns} ns after midnight, whose nanoseconds batchjob "
                    "would write back as microseconds; cast the column to time64[us] or to text"
                )
    return lost
