"""Result rows to Parquet parts, with one explicit schema for every part, committed atomically.

The schema is the input's columns (fixed when the job starts) followed by the result columns (and the
columns of the features a job turns on: ``sample_index``, ``choice_logprobs``, ``choice_probs`` (Arrow maps
from label to value), ``logprobs`` (a list of structs per generated token)). Text columns store any value, a
non-text one as JSON text; a value another column can't store unchanged is null there, and its row is an error
row saying why (the reader's check, ``batchjob.io.fits``).

Naming rule: an input column keeps its name unless it is one of the job's result or feature columns; then it
is written as ``input_<name>``, prefixed again (``input_input_<name>``, ...) until the name is free of every
input and result column. So no two columns of a part share a name, and the renaming is recorded in the part's
schema metadata (``batchjob.renamed``: output name -> input name), from which ``input_column`` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob import faults
from batchjob.io.atomic import replace_file, writing
from batchjob.io.fits import as_text, fits
from batchjob.io.schema import HF_KEY

RESULT_FIELDS = [
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_generated_tokens", pa.int64()),
    pa.field("error", pa.string()),
]
RESULT_NAMES = [f.name for f in RESULT_FIELDS]


def task_fields(
    task: str,
    width: int | None = None,
    num_labels: int = 1,
    token_logprobs: bool = False,
    head: str = "single",
) -> list[pa.Field]:
    """The result columns of a job of ``task`` (generate: ``RESULT_FIELDS``). ``width``: embed's embedding
    length; ``num_labels``: classify's head outputs (one: a ``score``; more: ``probs`` and ``label``);
    ``head``: classify's reading of them (multi: ``probs`` and ``labels``; regression: no ``probs``);
    ``token_logprobs``: score's per-token list."""
    if task == "generate":
        return list(RESULT_FIELDS)
    if task == "embed":
        if width is None:
            raise ValueError("an embed job's result columns need the embedding's width")
        out = [pa.field("embedding", pa.list_(pa.float32(), width))]
    elif task == "classify":
        out = [pa.field("scores", pa.list_(pa.float32()))]
        if head == "multi":
            out += [pa.field("probs", pa.list_(pa.float32())), pa.field("labels", pa.list_(pa.string()))]
        elif num_labels > 1 and head != "regression":
            out += [pa.field("probs", pa.list_(pa.float32())), pa.field("label", pa.string())]
        elif num_labels == 1:
            out.append(pa.field("score", pa.float32()))
    elif task == "score":
        out = [
            pa.field("logprob", pa.float64()),
            pa.field("num_scored_tokens", pa.int64()),
            pa.field("perplexity", pa.float64()),
        ]
        if token_logprobs:
            out.append(pa.field("token_logprobs", pa.list_(pa.float64())))
    else:
        raise ValueError(f"unknown task {task!r}")
    return out + [pa.field("num_prompt_tokens", pa.int64()), pa.field("error", pa.string())]


# A token and its log-probability (``--logprobs``): its text (``tokenizer.decode`` of the one token), its id.
TOKEN_LOGPROB = pa.struct(
    [pa.field("token", pa.string()), pa.field("token_id", pa.int64()), pa.field("logprob", pa.float64())]
)
LABEL_MAP = pa.map_(
    pa.string(), pa.float64()
)  # --choices: {label: value}, in the order the labels were given

EXTRA_FIELDS = {  # result columns a job adds when it uses the feature
    "reasoning": pa.field("reasoning", pa.string()),  # a reasoning model: the text between its think tags
    "sample_index": pa.field("sample_index", pa.int64()),  # --n: which of the row's samples
    "adapter": pa.field("adapter", pa.string()),  # --lora: the row's LoRA adapter (null: the base model)
    "choice_logprobs": pa.field("choice_logprobs", LABEL_MAP),  # --choices: {label: log-prob}
    "choice_probs": pa.field("choice_probs", LABEL_MAP),  # --choices: {label: prob}, sums to 1
    # --logprobs K: per generated token, the sampled token and its log-prob, and the top K (best first)
    "logprobs": pa.field(
        "logprobs",
        pa.list_(
            pa.struct(
                [
                    *TOKEN_LOGPROB,
                    pa.field("top_logprobs", pa.list_(TOKEN_LOGPROB)),
                ]
            )
        ),
    ),
}


PANDAS_KEY = b"pandas"  # schema metadata pandas writes: the frame's index and column types
RENAMED_KEY = b"batchjob.renamed"  # part schema metadata: JSON {output name: input name} of renamed inputs


# Result columns that export and status read as batchjob's own wherever a part has them (a row's samples, its
# adapter, an embeddings response, a reasoning model's thinking): an input column of one of these names is
# renamed even in a job that does not write it (an input 'sample_index' reordered the export and merged rows).
READ_BACK = {"sample_index", "adapter", "embedding", "reasoning"}


def output_names(
    input_names: list[str], extra: tuple[pa.Field, ...] = (), result: list[pa.Field] | None = None
) -> dict[str, str]:
    """``{input column: output name}`` by the module's naming rule (``result``: the job's result columns,
    default generation's; ``extra``: its feature columns)."""
    if len(set(input_names)) != len(input_names):  # readers.input_schema refuses such inputs first
        raise ValueError(f"input columns repeat a name: {input_names}")
    reserved = (
        {f.name for f in (RESULT_FIELDS if result is None else result)} | {f.name for f in extra} | READ_BACK
    )
    taken = set(input_names) | reserved
    out = {}
    for column in input_names:
        name = column
        if column in reserved:
            name = f"input_{column}"
            while name in taken:  # another input already has it (``error`` beside ``input_error``)
                name = f"input_{name}"
            taken.add(name)
        out[column] = name
    return out


def output_schema(
    input_schema: pa.Schema, extra: tuple[pa.Field, ...] = (), result: list[pa.Field] | None = None
) -> pa.Schema:
    result = RESULT_FIELDS if result is None else result
    names = output_names(input_schema.names, extra, result)
    fields = [pa.field(names[f.name], f.type) for f in input_schema]
    # pandas' record of the input frame's index (a RangeIndex is only this record) would label the output's
    # rows, which come in another order, with other rows' labels: the parts leave it out
    metadata = {k: v for k, v in (input_schema.metadata or {}).items() if k != PANDAS_KEY} or None
    renamed = {out: column for column, out in names.items() if out != column}
    if renamed and metadata and HF_KEY in metadata:
        metadata[HF_KEY] = _features_renamed(metadata[HF_KEY], names)
    # recorded too where an input column has a name another task reserves, so ``input_column`` never
    # takes such a part for one written before the record (``label`` kept beside an input ``input_label``)
    if renamed or not _ALL_RESULT_NAMES.isdisjoint(names):
        metadata = {**(metadata or {}), RENAMED_KEY: json.dumps(renamed, ensure_ascii=False).encode()}
    return pa.schema(fields + result + list(extra), metadata=metadata)


def _features_renamed(record: bytes, names: dict[str, str]) -> bytes:
    """``datasets``' record of the input's features with each feature under the name its column is written
    as: ``datasets`` decodes a column by the feature of its name, so a renamed input column's (an input
    ``num_prompt_tokens`` ClassLabel, written as ``input_num_prompt_tokens``) would decode the result's."""
    value = json.loads(record)
    features = (value.get("info") or {}).get("features")
    if not isinstance(features, dict):
        return record
    value["info"]["features"] = {names.get(k, k): v for k, v in features.items()}
    return json.dumps(value, ensure_ascii=False).encode()


# Every result or feature column name any task writes. A part written before the renaming was recorded
# renamed an input column of one of these names once (the ones its own task wrote), so ``input_column`` reads
# such a part by this list (an ``input_<name>`` beside it is taken for the renamed one).
_ALL_RESULT_NAMES = {
    f.name
    for fields in (
        task_fields("embed", 1),
        task_fields("classify", num_labels=1),
        task_fields("classify", num_labels=2),
        task_fields("classify", num_labels=2, head="multi"),
        task_fields("score", token_logprobs=True),
        RESULT_FIELDS,
        list(EXTRA_FIELDS.values()),
    )
    for f in fields
}


def input_column(part_schema: pa.Schema, column: str) -> str | None:
    """The name under which a part holds the input column ``column`` (None when it holds none): what the
    part's schema records of the renaming, or for a part without the record, the earlier single-prefix
    rule."""
    recorded = (part_schema.metadata or {}).get(RENAMED_KEY)
    if recorded is not None:
        by_input = {c: out for out, c in json.loads(recorded).items()}
        name = by_input.get(column, column)
    elif column in _ALL_RESULT_NAMES and f"input_{column}" in part_schema.names:
        name = f"input_{column}"
    else:
        name = column
    return name if name in part_schema.names else None


def file_sha256(path: Path) -> str:
    """The SHA-256 of a whole file, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _coerce(values: list[Any], type_: pa.DataType) -> pa.Array:
    """An array of ``type_`` from ``values``, nulling the ones that do not fit (the reader made their rows
    error rows, ``batchjob.io.fits``): pyarrow itself would store 2.5 in an integer column as 2."""
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return pa.array([None if v is None else as_text(v) for v in values], type=type_)
    if pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_boolean(type_):
        return pa.array([v if fits(v, type_) else None for v in values], type=type_)
    try:
        return pa.array(values, type=type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
        return pa.array([v if fits(v, type_) else None for v in values], type=type_)


def build_table(
    rows: list[dict[str, Any]],
    input_schema: pa.Schema,
    extra: tuple[pa.Field, ...] = (),
    result: list[pa.Field] | None = None,
) -> pa.Table:
    """A table with the output schema from result rows (input values and result fields in one dict)."""
    result = RESULT_FIELDS if result is None else result
    schema = output_schema(input_schema, extra, result)
    columns = []
    for field in input_schema:
        values = [(r.get("values") or {}).get(field.name) for r in rows]
        columns.append(_coerce(values, field.type))
    for field in result + list(extra):
        columns.append(pa.array([r.get(field.name) for r in rows], type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


class PartWriter:
    """Writes numbered parts ``{prefix}NNNNNN.parquet`` into the output folder, atomically.

    ``prefix``: ``"part-"``, or ``"part-00003-of-00008-"`` for one worker of several sharing the folder; a
    writer only ever writes or deletes names with its own prefix.
    """

    def __init__(
        self,
        out_dir: Path,
        input_schema: pa.Schema,
        prefix: str = "part-",
        extra: tuple[pa.Field, ...] = (),
        result: list[pa.Field] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.result = RESULT_FIELDS if result is None else result  # the task's result columns
        self.input_schema = input_schema
        self.prefix = prefix
        self.extra = extra  # the feature columns after the result columns
        self._own = re.compile(rf"\.?{re.escape(prefix)}\d{{6}}\.parquet(\.tmp)?")
        self._number = re.compile(rf"{re.escape(prefix)}(\d{{6,}})\.parquet")

    def part_name(self, seq: int) -> str:
        return f"{self.prefix}{seq:06d}.parquet"

    def next_seq(self, committed: Iterable[str]) -> int:
        """The number of the next part: one more than the highest of the ``committed`` parts, never the
        number of a file of ours on disk (after parts are dropped, their numbers are not reused)."""
        numbers = [int(m.group(1)) for n in committed if (m := self._number.fullmatch(n))]
        seq = max(numbers, default=-1) + 1
        while any((self.out_dir / n).exists() for n in (self.part_name(seq), f".{self.part_name(seq)}.tmp")):
            seq += 1
        return seq

    def write(self, seq: int, rows: list[dict[str, Any]]) -> str:
        """Write rows as part ``seq`` (temporary name, fsync, rename); returns the part's file name."""
        return self.write_table(seq, build_table(rows, self.input_schema, self.extra, self.result))

    def write_table(self, seq: int, table: pa.Table) -> str:
        """Write a table with the output schema as part ``seq``, atomically; returns the part's file name."""
        name = self.part_name(seq)
        tmp = self.out_dir / f".{name}.tmp"
        with writing(tmp):  # a full disk names the part; no temporary file is left behind
            pq.write_table(table, tmp, compression="zstd")
            faults.disk_write("part")
            replace_file(tmp, self.out_dir / name)
        return name

    @property
    def schema(self) -> pa.Schema:
        return output_schema(self.input_schema, self.extra, self.result)

    def size(self, name: str) -> int:
        """A part's size in bytes, as recorded in the manifest."""
        return (self.out_dir / name).stat().st_size

    def stamp(self, name: str) -> dict[str, Any]:
        """What the manifest records of a committed part to know it again: its size, the digest of its
        content, and its inode and status-change time (see ``batchjob.job.verify``)."""
        path = self.out_dir / name
        st = path.stat()
        return {"size": st.st_size, "sha256": file_sha256(path), "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}

    def remove_orphans(self, committed: set[str]) -> list[str]:
        """Delete parts and temporary files the manifest does not list (left by a crash). Returns them."""
        removed = []
        for entry in os.listdir(self.out_dir):
            match = self._own.fullmatch(entry)
            if match and entry not in committed and (entry.startswith(".") == bool(match.group(1))):
                (self.out_dir / entry).unlink()
                removed.append(entry)
        return removed
