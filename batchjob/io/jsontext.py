"""JSON text as rows are made of it: one JSONL line as an object or why it is not a usable row
(:func:`parse_line`), and a column's JSON text (messages, parameters, a request body) as a value
(:func:`loads_text`). What plain ``json.loads`` takes without a word is refused by name here: a key given
twice in an object (the last value would win), values nested past ``MAX_DEPTH``, half a UTF-16 pair
escaped in a string (``"\\udcff"``: no character, which no UTF-8 file or tokenizer takes), and a number
past float64's range (``1e400``, which ``json`` makes inf; no JSON number is infinite).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 100  # of a JSONL row's values: deeper ones are the row's error, well short of any recursion limit


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/objects more than ``limit`` levels deep (without recursion)."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [
            v
            for x in level
            if isinstance(x, (dict, list))
            for v in (x.values() if isinstance(x, dict) else x)
            if isinstance(v, (dict, list))
        ]
        if not level:
            return False
    return True


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> str | None:
    """Where a string of ``value`` (its keys too) holds a lone UTF-16 surrogate, as ``"key 'k': character 3
    (\\udcff)"``, else None. JSON text may escape one (``"\\udcff"``); Python takes it, but it is no character,
    and no UTF-8 file (Parquet, the tokenizer's input) can hold it."""
    stack: list[tuple[str, Any]] = [("the value", value)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            found = _SURROGATE.search(x)
            if found:
                return f"{where}: character {found.start()} ({ascii(found.group())[1:-1]})"
        elif isinstance(x, dict):
            stack.extend((f"key {k!r}", k) for k in x)
            stack.extend((f"key {k!r}", v) for k, v in x.items())
        elif isinstance(x, list):
            stack.extend((where, v) for v in x)
    return None


class RefusedText(ValueError):
    """JSON text that parses, but into what we refuse by name (the message says what and where)."""


class HalfPairError(RefusedText):
    """JSON text that escapes half a UTF-16 pair (see :func:`_lone_surrogate`)."""


def loads_text(text: str) -> Any:
    """``json.loads`` of JSON text held in a column (messages, parameters, a request body), held to a JSONL
    line's rules: it raises a :class:`RefusedText` (a ``ValueError``, as bad JSON raises) naming the key where
    an object gives one twice or a number is past float64's range (:class:`Overflow`), or
    :class:`HalfPairError` where a string in it is half a UTF-16 pair."""
    value = _loads(text)
    if ("\\ud" in text or "\\uD" in text) and (where := _lone_surrogate(value)):
        raise HalfPairError(f"a lone UTF-16 surrogate escape, not a character, at {where}")
    return value


def _replaced(value: Any) -> Any:
    """``value`` with each lone surrogate in its strings made U+FFFD (nested at most MAX_DEPTH levels)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replaced(v) for v in value]
    return value


class _RepeatedKey(RefusedText):
    """A JSON object that gives one key twice: ``json`` would keep the last value without a word."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _RepeatedKey(f"key {key!r} appears more than once in an object (which value is meant?)")
    return obj


class Overflow(RefusedText):
    """A JSON number past float64's range (``1e400``): ``json`` would make it inf without a word."""


def _number(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):  # no JSON number is infinite: its digits overflowed float64
        raise Overflow(f"the number {_shown(text)} is past float64's range (it would be read as {value})")
    return value


class _Huge(float):
    """A number past float64's range, kept as its text: to find where it is (:func:`_overflowed`)."""

    text: str


def _huge(text: str) -> float:
    value = float(text)
    if value not in (math.inf, -math.inf):
        return value
    huge = _Huge(value)
    huge.text = text
    return huge


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_float=_number)
_MARKING = json.JSONDecoder(object_pairs_hook=_object, parse_float=_huge)


def _loads(text: str | bytes, decoder: json.JSONDecoder = _DECODER) -> Any:
    """``json.loads`` (bytes decoded as it decodes them), refusing a key given twice in an object and a
    number past float64's range."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    return decoder.decode(text)


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _overflowed(obj: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``obj`` (read by ``_MARKING``) with each value that holds a number past float64's range made null, and
    why the row is an error, naming the first such column and number (None when there is none)."""
    why = None
    out = {}
    for key, value in obj.items():
        huge = _huge_in(value)
        if huge is not None and why is None:
            why = (
                f"column {key!r}: the number {_shown(huge.text)} is past float64's range (it would be stored "
                f"as {float(huge)}); write it as text (a JSON string) if it is meant"
            )
        out[key] = None if huge is not None else value
    return out, why


def _huge_in(value: Any) -> _Huge | None:
    """The first number past float64's range in ``value``, nested or not (without recursion)."""
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, _Huge):
            return x
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


def parse_line(text: str | bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One JSONL line as an object, or why it is not a usable row: bad JSON, a key given twice in an object,
    not an object, nested deeper than ``MAX_DEPTH``, half a UTF-16 pair in a string (then the object is
    returned too, each lone surrogate made U+FFFD), or a number past float64's range (the object is returned
    too, the column holding it null). Whatever the parser raises is the line's error, never the
    reader's stop."""
    huge = False
    try:
        try:
            obj = _loads(text)
        except Overflow:  # rare: read again, keeping each such number's text, to say where it is
            obj, huge = _loads(text, _MARKING), True
    except _RepeatedKey as e:
        return None, str(e)
    except RecursionError:
        return None, f"bad JSON (nested deeper than {MAX_DEPTH} levels)"
    except ValueError as e:
        return None, f"bad JSON ({e})"
    except Exception as e:  # noqa: BLE001 - a line can't stop the file
        return None, f"bad JSON ({type(e).__name__}: {e})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})"
    if _depth_over(obj, MAX_DEPTH):
        return None, f"values nested deeper than {MAX_DEPTH} levels"
    why = None
    if huge:  # the object, such numbers made null, keeps the line's --id-column value for its error row
        obj, why = _overflowed(obj)
    # text escapes a lone surrogate ("\\udcff"), or raw bytes hold one encoded (decoded with surrogatepass)
    maybe = not isinstance(text, str) or "\\ud" in text or "\\uD" in text
    if maybe and (where := _lone_surrogate(obj)):
        # the object, its surrogates replaced, keeps the line's --id-column value for its error row
        return _replaced(obj), f"a lone UTF-16 surrogate escape, not a character, at {where}"
    return obj, why
