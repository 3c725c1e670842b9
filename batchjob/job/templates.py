"""Prompt templates: text with ``{column}`` fields, parsed when the spec is checked, filled from one row.

Templates are data, never code: a field is a column name, optionally indexed into a struct/map or list column
(``{meta[title]}``, ``{tags[0]}``); attribute access, conversions, format specs and positional fields are
refused when the spec is checked, and rendering is our own substitution (``str.format`` never sees a row).
A value that can't be written exactly as text (bytes, a map with a key twice) or a prompt that renders empty is
the row's error, never a changed prompt. This module knows nothing of tokenizers or files.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any

from batchjob.errors import ConfigError

TEMPLATE_RULES = (
    "a template field is a column name in braces, like {review}, optionally indexed into a struct, map or "
    "list column, like {meta[title]} or {tags[0]}; no attribute access (.), conversions (!r), format specs (:>10) "
    "or positional fields ({}, {0}); write literal braces as {{ and }}"
)


@dataclass(frozen=True)
class TemplateField:
    """One ``{column[key][0]}`` field: the column, then the keys/indexes into its value."""

    text: str  # the field as written, for messages, e.g. "{meta[title]}"
    column: str
    path: tuple[str, ...]  # each [...] in order, as written (a list index is digits)


_FIELD = re.compile(r"^(?P<column>[^.\[\]]+)(?P<path>(\[[^\[\]]+\])*)$")


def parse_template(template: str) -> tuple[str | TemplateField, ...]:
    """The template as literal text and fields, in order; raises ``ConfigError`` naming a refused field."""
    try:
        parsed = list(string.Formatter().parse(template))  # parses only: no value is looked at here
    except ValueError as e:
        raise ConfigError(f"--template {template!r} is not a valid template: {e}; {TEMPLATE_RULES}") from e
    parts: list[str | TemplateField] = []
    for literal, name, spec, conversion in parsed:
        if literal:
            parts.append(literal)
        if name is None:
            continue
        text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        m = _FIELD.match(name)
        bare = re.sub(r"\[[^\[\]]*\]", "", name)  # the name without its [...] indexes
        why = None
        if conversion is not None:
            why = f"a conversion !{conversion}"
        elif spec:
            why = f"a format spec :{spec}"
        elif "." in bare:
            why = "attribute access"
        elif not bare.strip() or bare.isdigit():
            why = "an empty or numbered (positional) field"
        elif m is None:
            why = "not a column name"
        if why is not None or m is None:
            raise ConfigError(f"--template {template!r}: field {text} is refused ({why}); {TEMPLATE_RULES}")
        path = tuple(re.findall(r"\[([^\[\]]+)\]", m.group("path")))
        parts.append(TemplateField(text, m.group("column"), path))
    return tuple(parts)


def template_fields(template: str) -> tuple[str, ...]:
    """The columns a template uses, in order of first use; raises ``ConfigError`` for a refused template."""
    return tuple(dict.fromkeys(p.column for p in parse_template(template) if isinstance(p, TemplateField)))


_BYTES = (bytes, bytearray, memoryview)


class _Unusable(Exception):
    """Why a row's value can't fill a template field exactly; ``render_template`` makes it the row's error."""


@dataclass(frozen=True)
class MapValue:
    """A map column's value: its (key, value) pairs in Arrow's order (Arrow lets a key repeat)."""

    pairs: tuple[tuple[Any, Any], ...]


def _has(t: Any, kind: Any) -> bool:
    """Whether the pyarrow type ``t`` is, or holds anywhere in it, a type that ``kind`` (a check) is true of."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if kind(t):
        return True
    if pa.types.is_struct(t):
        return any(_has(t.field(i).type, kind) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has(t.value_type, kind)
    if pa.types.is_map(t):
        return _has(t.key_type, kind) or _has(t.item_type, kind)
    return False


def has_map(t: Any) -> bool:
    """Whether the pyarrow type ``t`` has a map anywhere in it."""
    import pyarrow as pa

    return _has(t, pa.types.is_map)


def _is_narrow_float(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_float32(t) or pa.types.is_float16(t))


def has_narrow_float(t: Any) -> bool:
    """Whether the pyarrow type ``t`` has a float32 or float16 anywhere in it: ``to_pylist`` widens such a
    value to a float64, whose text is not the column's (0.1 as 0.10000000149011612)."""
    return _has(t, _is_narrow_float)


def renders_by_type(t: Any) -> bool:
    """Whether a value of the pyarrow type ``t`` needs its type to render (``render_template``'s ``types``):
    a map (else a list of pairs) or a float32 or float16 (else its float64 widening)."""
    return has_map(t) or has_narrow_float(t)


def reads_narrow_float(template: str, types: tuple[tuple[str, Any], ...]) -> bool:
    """Whether ``template`` writes a float32 or float16 value into some prompt, as its columns' pyarrow
    ``types`` (``PromptPlan.types``) say, following each field's index path (a struct's other fields are not
    written); a map's or a list's items share one type, whatever the key or index."""
    import pyarrow as pa

    kinds = dict(types)
    for part in parse_template(template):
        if not isinstance(part, TemplateField) or part.column not in kinds:
            continue
        t = kinds[part.column]
        for key in part.path:
            if pa.types.is_dictionary(t):
                t = t.value_type
            if pa.types.is_struct(t):
                if t.get_field_index(key) < 0:
                    break  # no row has it: refused before work, or each row's error
                t = t.field(key).type
            elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
                t = t.value_type
            elif pa.types.is_map(t):
                t = t.item_type
            else:
                break
        if has_narrow_float(t):
            return True
    return False


def _narrow(value: float, t: Any) -> float:
    """A float32 or float16 value (type ``t``) that ``to_pylist`` widened to a float64, as the float64 of its
    shortest text at its own precision, so that str() and JSON write 0.1 as Arrow and pandas show it (not
    0.10000000149011612): numpy's text of a float32 or float16 is the shortest that reads back as it."""
    import numpy as np  # (numpy's shortest round-trip text of a float32 or float16; loaded with pyarrow)
    import pyarrow as pa

    kind = np.float16 if pa.types.is_float16(t) else np.float32
    return float(str(kind(value)))


def _with_maps(value: Any, t: Any) -> Any:
    """A row's ``value`` (from ``to_pylist``) with each map in it, as its type ``t`` says, a ``MapValue``, and
    each float32 or float16 in it at its own precision (``_narrow``); a value of another shape than ``t`` (a
    text column of mixed JSONL values) is left as it is."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if _is_narrow_float(t) and isinstance(value, float):
        return _narrow(value, t)
    if pa.types.is_map(t) and isinstance(value, list):
        return MapValue(tuple((_with_maps(k, t.key_type), _with_maps(v, t.item_type)) for k, v in value))
    if pa.types.is_struct(t) and isinstance(value, dict):
        kinds = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        return {k: _with_maps(v, kinds[k]) if k in kinds else v for k, v in value.items()}
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and isinstance(
        value, list
    ):
        return [_with_maps(v, t.value_type) for v in value]
    return value


def _name(where: str, column: str) -> str:
    return f"column {where!r}" if where == column else repr(where)


def _key_text(key: Any, where: str) -> str:
    """A map key as text, as a template indexes it and a rendered map writes it: text as it is, anything else
    as its JSON text (5 -> "5", true -> "true"; a date as str()). A map's keys share one type, so "5" in a
    map of integer keys can only be 5."""
    if isinstance(key, str):
        return key
    if isinstance(key, _BYTES):
        raise _Unusable(f"{where!r} has a key that is bytes, not text")
    if isinstance(key, (bool, int, float, list, dict)):
        return json.dumps(_plain(key, where, ""), ensure_ascii=False, default=str)
    return str(key)


def _plain(value: Any, where: str, column: str) -> Any:
    """``value`` as JSON can write it: a map as an object (keys by ``_key_text``); raises ``_Unusable`` for
    bytes at any depth, or a map holding a key twice (an object would keep one of them)."""
    if isinstance(value, _BYTES):
        raise _Unusable(f"{_name(where, column)} is bytes, not text (decode it to text in the input)")
    if isinstance(value, MapValue):
        out: dict[str, Any] = {}
        for k, v in value.pairs:
            key = _key_text(k, where)
            if key in out:
                raise _Unusable(_twice(value, key, where))
            out[key] = _plain(v, f"{where}[{key}]", column)
        return out
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k}]", column) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", column) for i, v in enumerate(value)]
    return value


def _twice(value: MapValue, key: str, where: str) -> str:
    times = sum(1 for k, _ in value.pairs if _key_text(k, where) == key)
    return f"{where!r} has the key [{key}] {times} times in this row; which one is meant is not known"


def _template_text(value: Any, where: str, column: str) -> str:
    """A field's value as prompt text: strings as they are, nested values (maps as objects) as compact JSON."""
    if isinstance(value, str):
        return value
    plain = _plain(value, where, column)
    return (
        json.dumps(plain, ensure_ascii=False, default=str) if isinstance(plain, (list, dict)) else str(plain)
    )


def _lookup(value: Any, key: str, where: str) -> tuple[bool, Any]:
    """``value[key]`` for a struct or map (by name; a map by ``_key_text``) or a list (by a digits index);
    (False, None) if absent; raises ``_Unusable`` for a map that holds the key twice."""
    if isinstance(value, MapValue):
        found = [v for k, v in value.pairs if _key_text(k, where) == key]
        if len(found) > 1:
            raise _Unusable(_twice(value, key, where))
        return (True, found[0]) if found else (False, None)
    if isinstance(value, dict):
        if key in value:
            return True, value[key]
        return (True, value[int(key)]) if key.isdigit() and int(key) in value else (False, None)
    if isinstance(value, (list, tuple)) and key.isdigit() and int(key) < len(value):
        return True, value[int(key)]
    return False, None


def _field_text(part: TemplateField, value: Any) -> str:
    """The text ``part`` puts in the prompt for its column's ``value``; raises ``_Unusable`` saying why none."""
    where = part.column
    try:
        for key in part.path:
            if value is None:
                break
            found, value = _lookup(value, key, where)
            if not found:
                raise _Unusable(f"{where!r} has no [{key}] in this row")
            where += f"[{key}]"
        if value is not None:
            return _template_text(value, where, part.column)
    except _Unusable as e:
        raise _Unusable(f"template field {part.text}: {e}") from None
    raise _Unusable(f"{_name(where, part.column)} is null")


def render_template(
    parts: tuple[str | TemplateField, ...], values: dict[str, Any], types: dict[str, Any] | None = None
) -> tuple[str | None, str | None]:
    """(text, None) or (None, why this row does not fill the template). ``types``: the pyarrow types of the
    columns that need them (``renders_by_type``; ``PromptPlan.types``), to tell a map from a list of pairs
    and write a float32 or float16 at its own precision."""
    out, empty = [], []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        if part.column not in values:
            return None, f"column {part.column!r} is missing in this row"
        value = values[part.column]
        if types and part.column in types:
            value = _with_maps(value, types[part.column])
        try:
            text = _field_text(part, value)
        except _Unusable as e:
            return None, str(e)
        if not text.strip():
            empty.append(_name(part.text[1:-1], part.column))
        out.append(text)
    text = "".join(out)
    return (text, None) if text.strip() else (None, _empty(list(dict.fromkeys(empty))))


def _empty(names: list[str]) -> str:
    """The error of a template that renders only whitespace, in the words of an empty prompt column."""
    if not names:
        return "the template renders only whitespace"
    if len(names) > 1 and all(n.startswith("column ") for n in names):
        names = [
            "columns " + names[0].removeprefix("column "),
            *(n.removeprefix("column ") for n in names[1:]),
        ]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} {'is' if len(names) == 1 else 'are'} empty"


# apply_chat_template's own arguments, which batchjob sets for every prompt: given again, every row failed
_RENDER_ARGUMENTS = {
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "chat_template",
    "tools",
    "documents",
    "padding",
    "truncation",
    "max_length",
}
# the names the template and transformers' renderer get the conversation under: given, every row was a TypeError
_CONVERSATION_NAMES = {"messages", "conversations"}


def template_kwargs(value: Any) -> dict[str, Any]:
    """--chat-template-kwargs (a JSON object, or its text) as the chat template's keyword arguments; one of
    ``apply_chat_template``'s own arguments is refused before any work."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ConfigError(
                f"chat_template_kwargs must be a JSON object, got {value[:200]!r} ({why})"
            ) from e
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"chat_template_kwargs must be a JSON object, got {value!r}")
    conversation = sorted(set(value) & _CONVERSATION_NAMES)
    if conversation:
        raise ConfigError(
            f"chat_template_kwargs: {conversation[0]!r} is the name the chat template reads each row's conversation "
            "under, which batchjob gives it (every row failed with a TypeError); keep only the template's own keys"
        )
    own = sorted(set(value) & _RENDER_ARGUMENTS)
    if own:
        raise ConfigError(
            f"chat_template_kwargs: {own[0]!r} is an argument batchjob gives apply_chat_template itself (every "
            "prompt is rendered with the assistant's turn opened, as text); keep only the template's own keys"
        )
    return value
