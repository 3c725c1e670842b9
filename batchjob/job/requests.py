"""Per-row requests: sampling parameters that come from the row, and OpenAI Batch API request lines.

Two ways a row brings its own parameters, both filling in the job's options for what the row leaves out:

- ``--params-column COL``: a JSON object (as text, or a struct column) of ``SamplingParams`` fields, e.g.
  ``{"max_new_tokens": 3, "temperature": 0.7}``;
- ``--format openai``: each line is a request of the OpenAI Batch API (``custom_id``, ``method``, ``url``,
  ``body``); the body's ``messages`` (chat) or ``prompt`` (completions) is the prompt and its fields are the
  parameters, with OpenAI's meaning (a request that leaves ``temperature`` out samples at 1).

A field this tool does not support, a wrong type or value, or a malformed request is the row's error (naming
the field), never a crash and never silently dropped. Everything here is a pure function of the row, so a
resumed job builds the same requests.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from batchjob.errors import ConfigError
from batchjob.io.jsontext import RefusedText, loads_text
from batchjob.job.chat_messages import ROLES as ROLES  # (named here too: the request format's roles)
from batchjob.job.chat_messages import chat_messages
from batchjob.sampling import (
    DRAW_ONLY,
    NUMBERS,
    SamplingParams,
    check_number,
    draw_only_given,
    greedy_samples,
)

_PARAM_TYPES: dict[str, tuple[type, ...]] = {  # numbers: sampling.NUMBERS, the one numeric check
    "regex": (str,),
    "ignore_eos": (bool,),
}
PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def _check_type(name: str, value: Any, where: str) -> str | None:
    if value is None:
        return None
    if name in NUMBERS:
        problem = check_number(name, value)
        return where + problem if problem else None
    if name in ("stop", "choices"):
        if isinstance(value, str) and name == "stop":
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return f"{where}{name} must be a list of strings, got {value!r}"
        return None
    if name == "stop_token_ids":
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return f"{where}{name} must be a list of token ids, got {value!r}"
        return None
    if name == "json_schema":
        return None if isinstance(value, (dict, str, bool)) else f"{where}{name} must be a JSON schema"
    ok = _PARAM_TYPES.get(name, (object,))
    if (isinstance(value, bool) and bool not in ok) or not isinstance(value, ok):
        kind = " or ".join(t.__name__ for t in ok).replace("int or float", "number")
        return f"{where}{name} must be {'an' if kind == 'int' else 'a'} {kind}, got {value!r}"
    return None


# A body field that turns a job option off (response_format text, logprobs false): not "left out" (None),
# which takes the job's.
OFF = object()


def with_params(
    base: SamplingParams, given: dict[str, Any], where: str
) -> tuple[SamplingParams | None, str | None]:
    """``base`` with the fields in ``given`` replaced (``OFF``: back to the field's default, off):
    ``(params, None)`` or ``(None, why not)``."""
    for name, value in given.items():
        if name not in PARAM_NAMES:
            return (
                None,
                f"{where}unknown sampling parameter {name!r} (known: {', '.join(sorted(PARAM_NAMES))})",
            )
        problem = None if value is OFF else _check_type(name, value, where)
        if problem:
            return None, problem
    merged = base.to_dict() | {k: v for k, v in given.items() if v is not None and v is not OFF}
    for k in [k for k, v in given.items() if v is OFF]:
        merged.pop(k, None)
    if any(given.get(k) is not None for k in ("choices", "json_schema", "regex")):  # one constraint at most
        for k in ("choices", "json_schema", "regex"):
            if given.get(k) is None:
                merged.pop(k, None)
    try:
        return SamplingParams.from_dict(merged), None
    except ConfigError as e:
        return None, f"{where}{e}"


def _as_base(base: SamplingParams, where: str) -> tuple[SamplingParams | None, str | None]:
    """The job's parameters for a row that gives none of its own. A job with per-row parameters may ask
    for --n samples at temperature 0, for its rows to give the temperature: a row that doesn't can't
    have them (n copies of one answer), and is refused as a row that gives n alone is."""
    problem = greedy_samples(base.n, base.temperature) or _greedy_draw({}, base, base)
    return (None, where + problem) if problem else (base, None)


def _greedy_draw(given: dict[str, Any], params: SamplingParams, base: SamplingParams) -> str | None:
    """Why a params-column row is refused for draw options it would decode greedily without (they were
    ignored without a word), or None: the row's own top_p, top_k, min_p or seed where its temperature is 0,
    and the job's --top-p, --top-k, --min-p where the row leaves the job's temperature 0 to it (as --n)."""
    if not params.greedy:
        return None
    named = [f"{k} {given[k]!r}" for k in draw_only_given(given)]
    if given.get("temperature") is None:
        job = draw_only_given({k: getattr(base, k) for k in DRAW_ONLY if k != "seed"})
        named += [f"the job's --{k.replace('_', '-')} {getattr(base, k)!r}" for k in job if k not in given]
    if not named:
        return None
    whose = "its temperature 0" if given.get("temperature") is not None else "the job's temperature 0"
    kind = "is an option of a draw" if len(named) == 1 else "are options of a draw"
    return (
        f"{', '.join(named)} {kind}, and this row decodes greedily at {whose}: give the row a temperature "
        f"above 0 to sample, or leave {'it' if len(named) == 1 else 'them'} out"
    )


def params_from_column(
    value: Any, column: str, base: SamplingParams
) -> tuple[SamplingParams | None, str | None]:
    """A row's ``--params-column`` value (JSON text or a struct) applied over the job's parameters."""
    where = f"params column {column!r}: "
    if value is None:
        return _as_base(base, where)
    if isinstance(value, str):
        try:
            value = loads_text(value) if value.strip() else {}
        except RefusedText as e:  # a key given twice, half a UTF-16 pair: named
            return None, f"{where}{e}"
        except (ValueError, RecursionError) as e:
            return None, f"{where}not JSON ({'nested too deeply' if isinstance(e, RecursionError) else e})"
        if value is None:  # JSON null: nothing of its own
            return _as_base(base, where)
    if not isinstance(value, dict):
        return None, f"{where}must be a JSON object of sampling parameters, got {type(value).__name__}"
    params, error = with_params(base, value, where)
    problem = None if params is None else _greedy_draw(value, params, base)
    return (None, where + problem) if problem else (params, error)


# -- OpenAI Batch API requests ----------------------------------------------------------------------------

REQUEST_FIELDS = ("custom_id", "method", "url", "body")  # what an OpenAI Batch request line has
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # --task embed
_EMBEDDING_FIELDS = {"input", "model", "dimensions", "encoding_format", "user"}
# Fields accepted and ignored: they change nothing about the answer.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Fields accepted at their neutral value only.
_NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "stream": False,
    "logit_bias": {},
    "echo": False,
    "best_of": 1,
    "suffix": None,
}


def _body_params(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The ``SamplingParams`` fields a request body asks for, or the error naming the field it can't have."""
    out: dict[str, Any] = {}
    known = {
        "messages" if chat else "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "logprobs",
        "response_format",
    }
    if chat:
        known |= {"max_completion_tokens", "top_logprobs"}
    for key, value in body.items():
        if key in _IGNORED or key in known:
            continue
        if key in _NEUTRAL and value in (_NEUTRAL[key], None):
            continue
        return None, f"body.{key} is not supported by batchjob" + (
            f" (only {_NEUTRAL[key]!r})" if key in _NEUTRAL else ""
        )
    for key in ("temperature", "top_p", "seed", "stop", "n"):
        if body.get(key) is not None:
            out[key] = body[key]
    for given, error in (
        _max_tokens(body),
        _logprobs(body, chat),
        _response_format(body.get("response_format")),
    ):
        if given is None:
            return None, error
        out |= given
    return out, None


def _max_tokens(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """``max_new_tokens`` from ``max_completion_tokens`` or its older name ``max_tokens``; given both, they
    must agree (which one was meant is not ours to guess)."""
    old, new = body.get("max_tokens"), body.get("max_completion_tokens")
    if old is not None and new is not None and (old != new or type(old) is not type(new)):
        return None, (
            f"body.max_tokens ({old!r}) and body.max_completion_tokens ({new!r}) differ: give one "
            "(max_tokens is the older name of max_completion_tokens)"
        )
    value, name = (new, "max_completion_tokens") if new is not None else (old, "max_tokens")
    problem = None if value is None else check_number("max_new_tokens", value)
    if problem:  # named as the body gives it (it was named max_new_tokens, which no body has)
        return None, f"body.{name}{problem.removeprefix('max_new_tokens')}"
    return ({} if value is None else {"max_new_tokens": value}), None


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any] | None, str | None]:
    """Log-probabilities: a completions body's ``logprobs`` is their number; a chat body's is a switch, true
    or false (a number or a string there was read as true), and ``top_logprobs`` their number."""
    flag = body.get("logprobs")
    if not chat:
        return ({} if flag is None else {"logprobs": flag}), None
    if flag is not None and not isinstance(flag, bool):
        return (
            None,
            f"body.logprobs must be true or false, got {flag!r} (how many per token: body.top_logprobs)",
        )
    if flag:
        return {"logprobs": body.get("top_logprobs") or 0}, None
    if body.get("top_logprobs") is not None:
        return None, "body.top_logprobs needs body.logprobs: true"
    return ({} if flag is None else {"logprobs": OFF}), None  # false: off, whatever the job's --logprobs


def _response_format(fmt: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A body's ``response_format`` as the ``json_schema`` constraint (none for ``text``), or the error."""
    if fmt is None:
        return {}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            return None, "body.response_format.json_schema.schema must be a JSON schema object"
        return {"json_schema": spec["schema"]}, None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}, None
    if kind != "text":
        return None, f"body.response_format.type {kind!r} is not supported (json_schema, json_object, text)"
    return {"choices": OFF, "json_schema": OFF, "regex": OFF}, None  # text: no constraint, the job's neither


def parse_request(
    values: dict[str, Any],
    base: SamplingParams,
    model_names: set[str] | None,
    pictured: frozenset[int] = frozenset(),
) -> tuple[dict[str, Any] | None, SamplingParams | None, str | None]:
    """An OpenAI Batch request line: ``({"messages": [...]} or {"prompt": str}, params, None)`` or the error.

    ``model_names``: when given, a body whose ``model`` is none of them is an error (``--check-model-name``).
    ``pictured``: the messages that hold an image (the image path gives them with their image parts taken
    out): their text may be empty.
    """
    body, error = _request_body(values, model_names)
    if body is None:
        return None, None, error
    chat = values.get("url") == CHAT_URL
    given, error = _body_params(body, chat)
    if given is None:
        return None, None, error
    params, error = with_params(base, given, "body: ")
    if params is None:
        return None, None, error
    if chat:
        messages, error = chat_messages(body.get("messages"), "body.messages", pictured)
        if messages is None:
            return None, None, error
        return {"messages": messages}, params, None
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return None, None, "body.prompt must be a non-empty string (lists of prompts are not supported)"
    if not prompt.strip():  # as an empty prompt column is
        return None, None, "body.prompt is empty (only whitespace)"
    return {"prompt": prompt}, params, None


def _request_body(
    values: dict[str, Any], model_names: set[str] | None
) -> tuple[dict[str, Any] | None, str | None]:
    """A completions or chat request line's body, its envelope checked (fields, custom_id, method, url,
    the body's model), or the error."""
    other = [k for k, v in values.items() if k not in REQUEST_FIELDS and v is not None]
    if other:
        return (
            None,
            (
                f"unknown request field {other[0]!r} (an OpenAI Batch request line has only "
                f"{', '.join(REQUEST_FIELDS)}; the parameters go in body)"
            ),
        )
    if not isinstance(values.get("custom_id"), str) or not values["custom_id"]:
        return None, f"custom_id must be a non-empty string, got {values.get('custom_id')!r}"
    method, url, body = values.get("method", "POST"), values.get("url"), values.get("body")
    if isinstance(body, str):  # a body column stored as JSON text
        try:
            body = loads_text(body)
        except RefusedText as e:  # a key given twice, half a UTF-16 pair: named
            return None, f"body: {e}"
        except ValueError as e:
            return None, f"body is not a JSON object ({e})"
    if method != "POST":
        return None, f"method {method!r} is not supported (POST)"
    if url not in (CHAT_URL, COMPLETIONS_URL):
        return None, f"url {url!r} is not supported ({CHAT_URL} or {COMPLETIONS_URL})"
    if not isinstance(body, dict):
        return None, "body must be a JSON object"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return None, f"body.model must be a string, got {model!r}"
    if model_names is not None and model is not None and model not in model_names:
        names = ", ".join(sorted(model_names))
        return None, f"body.model {body['model']!r} is not this job's model ({names})"
    return body, None


# A completions request in a job with --system: it was dropped from the request's prompt without a word
COMPLETIONS_NO_SYSTEM = (
    "--system is a system message, which a completions request (a 'prompt') has no place for: send it as a "
    "chat request (messages), or leave out --system"
)
# A completions request in a job with --chat-template-kwargs: its prompt does not go through the template
COMPLETIONS_NO_KWARGS = (
    "--chat-template-kwargs go to the chat template, which a completions request (a 'prompt') does not go "
    "through, so they would change nothing here: send it as a chat request (messages), or run the "
    "completions requests as a job without --chat-template-kwargs"
)


def parse_embeddings_request(
    values: dict[str, Any], model_names: set[str] | None, width: int
) -> tuple[list[str] | None, str | None]:
    """An OpenAI Batch ``/v1/embeddings`` request line (``--task embed --format openai``): its inputs (the
    body's ``input``, a string or a list of strings), or the error naming the field. ``width``: the job's
    embedding length, the one ``body.dimensions`` may ask for (the job's --dimensions sets it)."""
    other = [k for k, v in values.items() if k not in REQUEST_FIELDS and v is not None]
    if other:
        return (
            None,
            f"unknown request field {other[0]!r} (an OpenAI Batch request line has only {', '.join(REQUEST_FIELDS)})",
        )
    if not isinstance(values.get("custom_id"), str) or not values["custom_id"]:
        return None, f"custom_id must be a non-empty string, got {values.get('custom_id')!r}"
    method, url, body = values.get("method", "POST"), values.get("url"), values.get("body")
    if isinstance(body, str):
        try:
            body = loads_text(body)
        except RefusedText as e:  # a key given twice, half a UTF-16 pair: named
            return None, f"body: {e}"
        except ValueError as e:
            return None, f"body is not a JSON object ({e})"
    if method != "POST":
        return None, f"method {method!r} is not supported (POST)"
    if url != EMBEDDINGS_URL:
        return None, f"url {url!r} is not supported by --task embed ({EMBEDDINGS_URL})"
    if not isinstance(body, dict):
        return None, "body must be a JSON object"
    unknown = sorted(set(body) - _EMBEDDING_FIELDS)
    if unknown:
        return (
            None,
            f"body.{unknown[0]} is not supported by batchjob ({', '.join(sorted(_EMBEDDING_FIELDS))})",
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return None, f"body.model must be a string, got {model!r}"
    if model_names is not None and model is not None and model not in model_names:
        return None, f"body.model {model!r} is not this job's model ({', '.join(sorted(model_names))})"
    if body.get("encoding_format", "float") != "float":
        return None, f"body.encoding_format {body['encoding_format']!r} is not supported (float)"
    dims = body.get("dimensions")
    if dims is not None and dims != width:
        return None, (
            f"body.dimensions {dims!r} is not this job's embedding length {width} (a job has one length: "
            "give --dimensions to the job, and run requests of another length as a job of their own)"
        )
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) and t for t in inputs):
        return None, "body.input must be a non-empty string or a non-empty list of non-empty strings"
    return inputs, None
