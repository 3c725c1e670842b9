"""``batchjob export``: a job's results as JSONL, CSV or OpenAI Batch output lines, in input order.

Results live in Parquet parts, each sorted by (row ordinal, sample index), and the manifests say which ordinals
each part holds (half-open ranges). Reading every part as a stream of ``(ordinal, row)`` and merging the streams
gives the rows in input order (by file, then row) with one batch per part in memory, however large the output.
Only committed parts are read: an unfinished job exports what it has (and says so), a damaged part stops the
export with its name.
"""

from __future__ import annotations

import base64
import csv
import datetime
import hashlib
import heapq
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.errors import InputError, StateError
from batchjob.io.writers import input_column
from batchjob.job.inputs import split_ordinal
from batchjob.job.manifest import Manifest, PartRecord
from batchjob.job.owned import check_target
from batchjob.job.rows.base import ENGINE_FAILURE
from batchjob.job.shard import Shard
from batchjob.job.state import JobInfo, StateDir
from batchjob.job.verify import REDO, DamagedPartError, check_parts, read_batches

FORMATS = ("jsonl", "csv", "openai")
OPENAI_TASKS = ("generate", "embed")  # the tasks that have an OpenAI Batch response: completions, embeddings
_BATCH = 1024


@dataclass
class Result:
    ordinal: int
    row: dict[str, Any]  # the output columns of one result row


def _manifests(out_dir: Path, info: JobInfo) -> list[Manifest]:
    count = int((info.fingerprint.get("sharding") or {}).get("num_shards", 1))
    if count == 1:
        return [Manifest(StateDir(out_dir).manifest_file, readonly=True)]
    states = [StateDir(out_dir, Shard(i, count)) for i in range(count)]
    return [Manifest(s.manifest_file, readonly=True) for s in states if s.manifest_file.exists()]


def _part_rows(out_dir: Path, record: PartRecord) -> Iterator[Result]:
    """The rows of one part with their ordinals: each ordinal's rows are consecutive, sample 0 first."""
    ordinals = (o for a, b in record.ordinals for o in range(a, b))
    current = -1
    for batch in read_batches(out_dir, record.name, batch_size=_BATCH):
        names = batch.schema.names
        if len(set(names)) != len(names):  # a row as a dict would keep one of them only
            twice = sorted({n for n in names if names.count(n) > 1})
            raise StateError(
                f"{out_dir}: part {record.name} has more than one column named {', '.join(map(repr, twice))} "
                "(an earlier batchjob wrote an input column that clashed with a result column under a taken "
                "name); exporting it would drop one. Run the job again into a new --output, or read the part "
                "by column position with pyarrow.parquet"
            )
        for row in _rows(batch, record.name):
            if row.get("sample_index", 0) == 0:  # --n: a row's samples follow it; an error row has one
                current = next(ordinals, None)
                if current is None:
                    raise DamagedPartError(out_dir, record.name, "holds more rows than its record lists")
            yield Result(current, row)


def _rows(batch: pa.RecordBatch, part: str) -> list[dict[str, Any]]:
    """The rows of a batch, maps as objects (--choices'); a map that holds a key twice (an input's) as a list
    of [key, value] pairs, said on stderr, rather than an object keeping one of them."""
    try:
        return batch.to_pylist(maps_as_pydicts="strict")
    except KeyError:
        rows = []
        for j in range(batch.num_rows):
            one = batch.slice(j, 1)
            try:
                rows.append(one.to_pylist(maps_as_pydicts="strict")[0])
            except KeyError:
                print(
                    f"batchjob export: part {part} row {j}: a map holds a key twice, so its maps are written as "
                    "lists of [key, value] pairs",
                    file=sys.stderr,
                )
                rows.append(one.to_pylist()[0])
        return rows


def iter_results(out_dir: Path) -> tuple[JobInfo, Iterator[Result]]:
    """The job's saved info and its committed result rows in input order (one batch per part in memory)."""
    state = StateDir(out_dir)
    if not state.exists():
        raise InputError(f"{out_dir} holds no batchjob job (no {state.job_file})")
    info = state.load_job()
    streams = []
    for manifest in _manifests(out_dir, info):
        problems = check_parts(out_dir, manifest)
        if problems:
            raise StateError(f"{out_dir}: {', '.join(str(p) for p in problems)}; {REDO}, then export")
        streams += [_part_rows(out_dir, r) for r in manifest.parts]
    merged = heapq.merge(*streams, key=lambda r: (r.ordinal, r.row.get("sample_index", 0)))
    return info, merged


def _id_name(out_dir: Path, info: JobInfo, id_column: str | None) -> str | None:
    """The name the parts hold the ``--id-column`` under (an input column named like a result column is
    renamed: ``writers.input_column``), read from the first committed part."""
    if id_column is None:
        return None
    for manifest in _manifests(out_dir, info):
        for record in manifest.parts:
            try:
                return input_column(pq.read_schema(out_dir / record.name), id_column)
            except (OSError, pa.ArrowException) as e:
                raise DamagedPartError(out_dir, record.name, f"cannot be read ({e})") from e
    return id_column


def _id_of(result: Result, info: JobInfo, id_name: str | None) -> str:
    if id_name is not None and result.row.get(id_name) is not None:
        return str(result.row[id_name])
    seq, index = split_ordinal(result.ordinal)
    names = {r.seq: r.name for r in info.inputs}
    return f"{names.get(seq, seq)}:{index}"


def _json_default(value: Any) -> Any:
    """A value JSON has no type for: dates, times and durations in ISO 8601, bytes (a binary column: images,
    say) in base64 (their Python repr, ``b'\\x89PNG...'``, was written before), anything else as its text."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.timedelta):  # pandas' Timedelta (a duration[ns] column) is one too
        return _iso_duration(value)
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _iso_duration(value: datetime.timedelta) -> str:
    """A duration in ISO 8601, laid out as pandas' ``Timedelta.isoformat`` (``P2DT0H0M5S``, ``P0DT0H0M1.5S``:
    what a duration[ns] column exported as before), a negative one with one leading sign (``-P0DT0H0M1S``,
    as ISO 8601-2 and XML Schema write it; pandas reads it back). Python's ``str`` wrote ``-1 day, 23:59:59``
    and pandas writes ``P-1DT23H59M59S``: a day back and a positive remainder, which a reader misreads."""
    ns = ((value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds) * 1000
    ns += getattr(value, "nanoseconds", 0)  # pandas' Timedelta: below the microsecond
    days, rest = divmod(abs(ns), 86_400 * 10**9)
    hours, rest = divmod(rest, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    seconds, fraction = divmod(rest, 10**9)
    text = f"{seconds}.{fraction:09d}".rstrip("0") if fraction else str(seconds)
    return f"{'-' if ns < 0 else ''}P{days}DT{hours}H{minutes}M{text}S"


def _openai_line(group: list[Result], info: JobInfo, id_column: str | None, model: str, created: int) -> dict:
    """One OpenAI Batch output line for a request: its samples are the choices of one response."""
    first = group[0].row
    model = first.get("adapter") or model  # a LoRA row answers as its adapter's name, as vLLM names it
    # Only an OpenAI Batch input's lines are requests with a custom_id and a url of their own; a rows job's
    # columns of those names are the user's data (its custom_id is the row id, its response a chat one).
    requests = (info.fingerprint.get("prompt") or {}).get("format") == "openai"
    custom_id = _id_of(group[0], info, (id_column or "custom_id") if requests else id_column)
    digest = hashlib.sha256(f"{info.job_seed}:{custom_id}".encode()).hexdigest()[:24]
    line: dict[str, Any] = {
        "id": f"batch_req_{digest}",
        "custom_id": custom_id,
        "response": None,
        "error": None,
    }
    failed = next((r.row for r in group if r.row.get("error") is not None), None)
    if failed is not None:
        # One failed sample (or embeddings input) fails the request, as OpenAI has no error per choice; as
        # OpenAI and vLLM write a failed request: its HTTP status and error body in ``response``. A request
        # refused (a bad row, a prompt too long, refused by the engine at admission) is a bad request (400);
        # only one the engine failed to run is the server's failure (500).
        message = failed["error"]
        if len(group) > 1 and "embedding" not in first:
            message = f"sample {failed.get('sample_index', 0)} of {len(group)}: {message}"
        status = 500 if failed["error"] == ENGINE_FAILURE else 400
        kind = "invalid_request_error" if status == 400 else "server_error"
        error = {"message": message, "type": kind, "param": None, "code": "batchjob_error"}
        line["response"] = {"status_code": status, "request_id": digest, "body": {"error": error}}
        line["error"] = {"code": "batchjob_error", "message": message}
        return line
    if "embedding" in first:  # --task embed: an embeddings response, an object per input
        line["response"] = {"status_code": 200, "request_id": digest, "body": _embeddings_body(group, model)}
        return line
    completions = requests and str(first.get("url") or "").endswith("/v1/completions")
    choices = [_openai_choice(r.row, completions) for r in group]
    prompt = first.get("num_prompt_tokens") or 0
    generated = sum(r.row.get("num_generated_tokens") or 0 for r in group)
    body = {
        "id": f"{'cmpl' if completions else 'chatcmpl'}-{digest}",
        "object": "text_completion" if completions else "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        },
    }
    line["response"] = {"status_code": 200, "request_id": digest, "body": body}
    return line


def _openai_choice(row: dict[str, Any], completions: bool) -> dict[str, Any]:
    """One sample as a choice: its text (a chat message: with a reasoning model's thinking as
    ``reasoning_content``, as vLLM's and DeepSeek's servers write it), finish reason and log-probabilities."""
    choice: dict[str, Any] = {
        "index": row.get("sample_index", 0),
        "finish_reason": row["finish_reason"],
        "logprobs": _openai_logprobs(row.get("logprobs"), completions, row["generated_text"] or ""),
    }
    if completions:
        choice["text"] = row["generated_text"]
    else:
        choice["message"] = {"role": "assistant", "content": row["generated_text"], "refusal": None}
        if row.get("reasoning") is not None:
            choice["message"]["reasoning_content"] = row["reasoning"]
    return choice


def _embeddings_body(group: list[Result], model: str) -> dict[str, Any]:
    """The body of an OpenAI ``/v1/embeddings`` response: the group's rows (a request's inputs, by
    ``sample_index``) as embedding objects, float encoded."""
    data = [
        {"object": "embedding", "index": r.row.get("sample_index", 0), "embedding": r.row["embedding"]}
        for r in group
    ]
    prompt = group[0].row.get("num_prompt_tokens") or 0  # the request's inputs together
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }


def _openai_logprobs(tokens: Any, completions: bool, text: str = "") -> dict[str, Any] | None:
    """A sample's ``logprobs`` column in OpenAI's shape: chat ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``, completions ``{tokens, token_logprobs, top_logprobs, text_offset}``. A token's text is
    what it adds to the output's text (docs/labels.md: a special token's is empty, a character made of several
    tokens is the last one's), so ``bytes``, the UTF-8 of that text, join to the text's; ``text_offset``
    (``_text_offsets``) is where each token's text starts in ``text``."""
    if tokens is None:
        return None
    if isinstance(tokens, str):  # a part written before the column was structured: JSON of ids only
        return None
    if completions:
        return {
            "tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            # the chosen token's too, as OpenAI's (a text two tokens share is one key there)
            "top_logprobs": [
                {x["token"]: x["logprob"] for x in t["top_logprobs"]} | {t["token"]: t["logprob"]}
                for t in tokens
            ],
            "text_offset": _text_offsets([t["token"] for t in tokens], text),
        }

    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}

    content = [entry(t) | {"top_logprobs": [entry(x) for x in t["top_logprobs"]]} for t in tokens]
    return {"content": content, "refusal": None}


def _text_offsets(tokens: list[str], text: str) -> list[int]:
    """Where each token's text starts in ``text`` (characters, as OpenAI's ``text_offset``): the tokens' texts
    join to the decoded output, which the text begins (a stop string cut it: the tokens from the cut on, the
    stop string's, are at the text's end) or ends (think tags split it: the reasoning's tokens are at 0).
    A token whose text is empty (EOS) is where the next one starts; no offset is past the text's end."""
    joined = "".join(tokens)
    base = 0 if joined.startswith(text) else max(joined.rfind(text), 0)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(min(max(at - base, 0), len(text)))
        at += len(token)
    return offsets


def export(out_dir: Path, fmt: str, to: IO[str]) -> int:
    """Write the job's results to ``to`` in ``fmt``; returns the number of lines (rows, or requests) written."""
    if fmt not in FORMATS:
        raise InputError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    info, results = iter_results(out_dir)
    task = str((info.fingerprint.get("task") or {}).get("task", "generate"))
    if fmt == "openai" and task not in OPENAI_TASKS:
        raise InputError(
            f"--format openai: a {task} job's results have no OpenAI Batch response (OpenAI's have "
            f"completions, chat and embeddings only); export {out_dir} with --format jsonl or csv"
        )
    id_column = _id_name(out_dir, info, (info.fingerprint.get("prompt") or {}).get("id_column"))
    written, nulled = 0, [0]
    if fmt == "jsonl":
        for r in results:
            to.write(_json_line(r.row, nulled))
            written += 1
    elif fmt == "csv":
        writer: Any = None
        for r in results:
            if writer is None:
                # RFC 4180's line end: a value holding a lone \r is then quoted too (with \n alone it was not,
                # and readers split the row there)
                writer = csv.DictWriter(to, fieldnames=list(r.row), lineterminator="\r\n")
                writer.writeheader()
            writer.writerow({k: _csv_value(v) for k, v in r.row.items()})
            written += 1
    else:
        model = _model_name(info)
        created = int(time.time())
        for _, group in groupby(results, key=lambda r: r.ordinal):
            line = _openai_line(list(group), info, id_column, model, created)
            to.write(_json_line(line, nulled))
            written += 1
    if nulled[0]:
        print(
            f"batchjob export: {nulled[0]} NaN or infinite values written as null (JSON has no such numbers; "
            "--format csv writes them as nan, inf)",
            file=sys.stderr,
        )
    return written


def _json_line(value: Any, nulled: list[int]) -> str:
    """One line of standard JSON: a NaN or infinite float (no JSON number; ``json`` would write the bare
    ``NaN`` that strict readers refuse and jq reads as null) as null, counted in ``nulled``."""
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default, allow_nan=False) + "\n"
    except ValueError:
        finite = _nulled(value, nulled)
        return json.dumps(finite, ensure_ascii=False, default=_json_default, allow_nan=False) + "\n"


def _nulled(value: Any, nulled: list[int]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        nulled[0] += 1
        return None
    if isinstance(value, dict):
        return {k: _nulled(v, nulled) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulled(v, nulled) for v in value]
    return value


def _csv_value(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=_json_default)
    if isinstance(value, (bytes, bytearray, memoryview, datetime.timedelta)) or hasattr(value, "isoformat"):
        return _json_default(value)  # base64; dates, times and durations in ISO 8601, as jsonl writes them
    return value


def _model_name(info: JobInfo) -> str:
    identity = (info.fingerprint.get("model") or {}).get("identity") or {}
    return str(identity.get("name") or identity.get("hub_id") or "batchjob-local-model")


def export_to(out_dir: Path, fmt: str, to: str | None) -> tuple[int, str]:
    """``export`` into the file ``to`` (written to a temporary name, then renamed) or to stdout."""
    if to is None or to == "-":
        return export(out_dir, fmt, sys.stdout), "standard output"
    target = Path(to)
    check_target(target, "--to", [out_dir])
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        f = open(tmp, "w", encoding="utf-8", newline="")  # noqa: SIM115 - closed below
    except OSError as e:  # a missing or read-only folder: name the path given, not our temporary file
        raise InputError(
            f"--to {target}: cannot write in {target.parent} ({e.strerror or e}); give a file in an existing, "
            "writable folder"
        ) from e
    try:
        with f:
            n = export(out_dir, fmt, f)
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written is left beside the target
        raise
    return n, str(target)
