"""The columns of a job's inputs: each file's schema (Parquet and saved datasets their own, JSONL inferred from
its first 1,000 objects), their union over the files of one job, and whether a file added later fits it.
"""

from __future__ import annotations

import codecs
from typing import Any

import pyarrow as pa

from batchjob.errors import InputError
from batchjob.io.jsontext import parse_line
from batchjob.io.sources import Source, _fsspec, load_hf, open_binary

_SCHEMA_SAMPLE_ROWS = 1000


def parquet_file(source: Source) -> Any:
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


def strip_bom(raw: bytes, lineno: int) -> bytes:
    return raw[len(codecs.BOM_UTF8) :] if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else raw


def _jsonl_kinds(source: Source) -> dict[str, set[type]]:
    """The value types of each key over the first 1,000 objects of a JSONL file, keys in order of first sight."""
    columns: dict[str, set[type]] = {}
    n = 0
    with open_binary(source) as f:
        for lineno, raw in enumerate(f, 1):
            if n >= _SCHEMA_SAMPLE_ROWS:
                break
            obj, error = parse_line(strip_bom(raw, lineno))
            if obj is not None and error is None:  # an error row's keys are no columns
                n += 1
                for k, v in obj.items():
                    columns.setdefault(str(k), set()).add(type(v))
    return columns


class RepeatedColumnError(InputError):
    """An input file with two columns of one name: its rows can't be read as name -> value, so the job stops
    before work (not an error row, as another unreadable file is)."""


def table_schema(source: Source) -> pa.Schema:
    schema = parquet_file(source).schema_arrow if source.kind == "parquet" else _splits_schema(source)
    repeated = sorted({n for n in schema.names if schema.names.count(n) > 1})
    if repeated:
        raise RepeatedColumnError(
            f"input {source.path} has more than one column named {', '.join(map(repr, repeated))}: a row "
            "can't hold two values under one name. Rename them in the file, or leave the file out"
        )
    return schema


def _splits_schema(source: Source) -> pa.Schema:
    """The columns of a saved dataset's splits, which must agree on their columns and types, and on their
    features: the parts carry one ``huggingface`` record of them, which ``datasets`` decodes every row by (a
    ClassLabel's names: 1 is 'pos' in one split, 'neg' in another)."""
    splits = load_hf(source)
    first, schema = splits[0][0], splits[0][1].features.arrow_schema
    for split, ds in splits[1:]:
        other = ds.features.arrow_schema
        if not other.equals(schema):  # the rows of one would be read into the other's columns
            raise InputError(
                f"input {source.path}: its splits {first!r} and {split!r} have different columns "
                f"or types ({_columns(schema)}; {_columns(other)}); give one split's folder as the input, "
                f"e.g. {source.path}/{split}"
            )
        if not other.equals(schema, check_metadata=True):
            named, own = splits[0][1].features, ds.features
            column = next((c for c in own if own[c] != named.get(c)), None)
            which = f" for column {column!r} ({named[column]}; {own[column]})" if column is not None else ""
            raise InputError(
                f"input {source.path}: its splits {first!r} and {split!r} have different features{which}, and "
                "the output can describe its rows by one split's only (a ClassLabel's names would decode the "
                f"other's labels wrong); give one split's folder as the input: {source.path}/{first} or "
                f"{source.path}/{split}"
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


def _text_as_string(named: list[tuple[str, pa.Schema]]) -> list[tuple[str, pa.Schema]]:
    """``named`` with a column that is text in every file but of types Arrow does not merge (a pandas
    categorical's dictionary beside plain strings, a string_view) made plain text, as ``--append`` takes such
    a file into a job of text (``compatible``); text of other types stays as ``_unify`` merges it."""
    types: dict[str, set[pa.DataType]] = {}
    for _, schema in named:
        for f in schema:
            types.setdefault(f.name, set()).add(f.type)
    mixed = set()
    for name, found in types.items():
        if len(found) > 1 and all(_is_text(t) or pa.types.is_null(t) for t in found):  # null: no values
            try:
                pa.unify_schemas([pa.schema([(name, t)]) for t in found], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                mixed.add(name)
    if not mixed:
        return named
    return [
        (
            name,
            pa.schema(
                [_mark_text(pa.field(f.name, pa.string())) if f.name in mixed else f for f in schema],
                metadata=schema.metadata,
            ),
        )
        for name, schema in named
    ]


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
                table = table_schema(source)
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
    schema = _unify(_text_as_string(named)) if len(named) > 1 else named[0][1]
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
        metadata=_shared_metadata(named),
    )


def _shared_metadata(named: list[tuple[str, pa.Schema]]) -> dict[bytes, bytes] | None:
    """The schema metadata every input has alike. A key one input lacks or gives otherwise describes only
    some of the rows: a saved dataset's ``huggingface`` features, which ``datasets`` decodes the output's
    rows by (a ClassLabel's names), would decode the other files' labels with names they never had."""
    first = named[0][1].metadata or {}
    return {
        k: v for k, v in first.items() if all((s.metadata or {}).get(k) == v for _, s in named[1:])
    } or None


HF_KEY = b"huggingface"  # schema metadata of datasets: the features (ClassLabel names, ...) rows decode by
TEXT_ONLY = {b"batchjob": b"text"}  # field metadata: the column holds text (not JSON text of nested values)


def _is_text(t: pa.DataType) -> bool:
    """A column type of text: string, large_string, string_view, or a dictionary of one of them."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _mark_text(f: pa.Field) -> pa.Field:
    return f.with_metadata(TEXT_ONLY) if _is_text(f.type) else f


def is_text_only(f: pa.Field) -> bool:
    """Whether a column of the job's input schema is known to hold only text: a string column of a Parquet
    file or dataset, a JSONL key whose values (in the rows the schema was inferred from) were all strings.
    A JSONL key with nested or mixed values is stored as (JSON) text too, but its rows hold the values."""
    return (f.metadata or {}).get(b"batchjob") == b"text"


def compatible(saved: pa.Schema, source: Source) -> str | None:
    """Why a file added to a job (``--append``) does not fit the job's columns, or None when it does."""
    schema = source_schema(source)
    features = (saved.metadata or {}).get(HF_KEY)
    if features is not None and (schema.metadata or {}).get(HF_KEY) != features:
        return (
            "its datasets features (the 'huggingface' schema metadata, such as a ClassLabel's names) are not "
            "the job's, which its parts carry and decode every row by; give the file the job's features, or "
            "send it to a new --output"
        )
    names = set(saved.names)
    for f in schema:
        if f.name not in names:
            return f"column {f.name!r} is new (the job's columns: {', '.join(saved.names)})"
        want = saved.field(f.name).type
        # a JSONL key of mixed values is JSON text, as in a job of both files; a table's text column of
        # another text type (polars' large_string, a pandas categorical) is text; any other keeps its type
        if f.type == want or (pa.types.is_string(want) and (source.kind == "jsonl" or _is_text(f.type))):
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
