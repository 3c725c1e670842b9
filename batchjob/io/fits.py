"""Whether a row's values can be written back as they were read: each one fits its column in the job's schema.

The job's columns are fixed before its first row is read: a JSONL file's from the keys and value types of its
first 1,000 lines, several files' merged into one schema (an int64 column of one file and a float64 column of
another make a float64 column). A row past those lines, or from the other file, may hold a value its column
cannot store as it is: text in an integer column, 2.5 in an integer column (pyarrow would store 2), an integer
past 2**53 in a float column (stored rounded), an integer past 2**63 (stored as null), a key the first lines
never had (dropped). Written, such a row would say its input was something else; it is an error row instead,
naming the value, the column and how to go on (``Fit.why``), with the values that do fit kept.

Only what can differ is checked: every value of a JSONL file (its types were guessed from a sample), and in a
Parquet file or dataset only the columns whose type in that file is not the job's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pyarrow as pa

SAMPLE_NOTE = "the columns and their types are read from the first 1,000 lines of each JSONL file"


def fits(value: Any, type_: pa.DataType) -> bool:
    """Whether ``value`` (as read: a Python value) is stored in a column of ``type_`` unchanged."""
    if value is None or pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return True  # text columns take any value as its text (JSON for the rest)
    if pa.types.is_boolean(type_):
        return isinstance(value, bool)
    if pa.types.is_integer(type_):
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        if pa.types.is_unsigned_integer(type_):
            return 0 <= value < 2**type_.bit_width
        return -(2 ** (type_.bit_width - 1)) <= value < 2 ** (type_.bit_width - 1)
    if pa.types.is_float64(type_):
        if isinstance(value, bool):
            return False
        if isinstance(value, int):
            return abs(value) <= 2**1023 and float(value) == value  # exactly, past 2**53 too
        return isinstance(value, float)
    try:  # nested, temporal, decimal and narrower types: through Arrow and back
        back = pa.array([value], type=type_).to_pylist()[0]
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
        TypeError,
        ValueError,
    ):
        return False
    return back == value or back == _filled(value, type_) or _both_nan(back, value)


def _filled(value: Any, type_: pa.DataType) -> Any:
    """``value`` with the struct fields it lacks as None, as its column gives them back: a field another
    file's struct has (a column that gained a field) is null in this file's rows, their values unchanged."""
    if isinstance(value, dict) and pa.types.is_struct(type_):
        names = [type_.field(i).name for i in range(type_.num_fields)]
        if not set(value) <= set(names):
            return value
        return {n: _filled(value.get(n), type_.field(n).type) for n in names}
    if isinstance(value, list) and (pa.types.is_list(type_) or pa.types.is_large_list(type_)):
        return [_filled(v, type_.value_type) for v in value]
    return value


def column_type(schema: pa.Schema, name: str | None) -> pa.DataType | None:
    return schema.field(name).type if name is not None and name in schema.names else None


def as_text(value: Any) -> str:
    """What a text column stores for ``value``: a string as it is, any other value as its JSON text."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def id_text(value: Any, type_: pa.DataType | None) -> str:
    """A row id as its column writes it: a text column writes a non-text value as JSON (``true``, ``NaN``), a
    float column an integer as a float, so two ids are one exactly when their written values are one."""
    if type_ is None or isinstance(value, str):
        return str(value)
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return as_text(value)
    if pa.types.is_floating(type_) and isinstance(value, int) and not isinstance(value, bool):
        return str(float(value))
    return str(value)


def _test(type_: pa.DataType) -> Callable[[Any], bool]:
    """``fits`` for one column's type, the common ones without asking the type each time (a row's check)."""
    if type_ == pa.int64():
        return lambda v: type(v) is int and -(2**63) <= v < 2**63
    if type_ == pa.bool_():
        return lambda v: type(v) is bool
    if type_ == pa.float64():
        return lambda v: type(v) is float or fits(v, type_)
    return lambda v: fits(v, type_)


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


class Fit:
    """The check of one source's rows against the job's ``schema``: ``columns`` to check (None: every value
    of a JSONL row, and keys that are not columns); ``note`` says where the job's types came from."""

    def __init__(self, schema: pa.Schema, own: pa.Schema | None) -> None:
        self.types = {f.name: f.type for f in schema}
        if own is None:  # JSONL: every value
            self.columns: set[str] | None = None
            self.note = SAMPLE_NOTE
        else:
            self.columns = {f.name for f in own if f.name in self.types and f.type != self.types[f.name]}
            self.note = "the job's columns merge its input files' types"
        # the columns whose values are checked one by one: a text column takes any value
        self.typed = [
            (name, t, _test(t))
            for name, t in self.types.items()
            if (self.columns is None or name in self.columns)
            and not (pa.types.is_string(t) or pa.types.is_large_string(t))
        ]

    @property
    def checks(self) -> bool:
        return self.columns is None or bool(self.typed)

    def value_fits(self, name: str, value: Any) -> bool:
        if self.columns is not None and name not in self.columns:
            return True
        type_ = self.types.get(name)
        return type_ is not None and fits(value, type_)

    def why(self, values: dict[str, Any]) -> str | None:
        """Why ``values`` can't be written as read (the first value at fault), or None; the caller then
        nulls what does not fit (``kept``)."""
        if self.columns is None and not values.keys() <= self.types.keys():
            name = next(k for k in values if k not in self.types)
            return (
                f"key {name!r} is not a column of the job ({self.note}), so its value would be lost: "
                "give the key (a null is enough) in one of the first 1,000 lines, or leave it out"
            )
        for name, type_, test in self.typed:
            value = values.get(name)
            if value is None or test(value):
                continue
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            return (
                f"column {name!r}: {shown} ({type(value).__name__}) can't be stored unchanged in the column's "
                f"type {type_} ({self.note}): give the column one type throughout, e.g. text"
            )
        return None

    def kept(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with what does not fit its column nulled, and keys that are no column left out."""
        return {
            name: value if self.value_fits(name, value) else None
            for name, value in values.items()
            if name in self.types
        }
