"""A JSON schema or regex compiled to an llguidance grammar, and checked: the one place that knows how.

``SamplingParams`` checks a request's grammar with it when the request is made (so a bad one fails early);
the engine's constraints (:mod:`.constraints`) compile the same grammar for a tokenizer. It imports nothing of
either, so both import it.
"""

from __future__ import annotations

import functools
import json
import re

from batchjob.errors import ConfigError


def _no_extra_keys(schema: object) -> object:
    """The schema with ``additionalProperties: false`` on every object that lists its properties and says
    nothing about others: the answer holds the keys the schema names (still valid against the original),
    and a model cannot pad it with keys of its own."""
    if isinstance(schema, list):
        return [_no_extra_keys(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _no_extra_keys(v) if k not in ("enum", "const", "default", "examples") else v
        for k, v in schema.items()
    }
    if (
        isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def grammar_of(json_schema: str | None, regex: str | None) -> tuple[str, str, str]:
    """(kind, text, llguidance grammar) of a json_schema or else a regex; raises ConfigError if invalid."""
    import llguidance  # an optional, heavy package: loaded when a row first asks for a grammar

    M = llguidance.LLMatcher
    if json_schema is not None:
        kind, text = "json_schema", json_schema
    else:
        assert regex is not None
        kind, text = "regex", regex
    try:
        if kind == "json_schema":
            schema = _no_extra_keys(json.loads(text))
            grammar = M.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        else:
            grammar = M.grammar_from_regex(text)
        error = M.validate_grammar(grammar)
    except (ValueError, RuntimeError) as e:
        error = str(e)
    if error and not error.startswith("WARNING"):
        raise ConfigError(f"{kind} could not be compiled: {' '.join(error.split())}; got {text[:200]!r}")
    return kind, text, grammar


@functools.lru_cache(maxsize=64)
def _validator(json_schema: str):
    import jsonschema  # loaded with the first finished JSON answer

    schema = json.loads(json_schema)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@functools.lru_cache(maxsize=64)
def _pattern(regex: str) -> re.Pattern | None:
    try:
        return re.compile(regex)
    except re.error:  # a regex llguidance reads and Python's re does not: its answers go unchecked
        return None


def answer_error(json_schema: str | None, regex: str | None, text: str) -> str | None:
    """Why a finished answer's text is not one its schema or regex allows, else None. The grammar checked
    its tokens, but the text is their decoding (a tokenizer may drop a first space or clean spaces up) and
    llguidance's checks are not all the schema's (a pattern's negated class let an escaped quote through, a
    date February 29 of any year): the text is checked against the user's own schema or regex."""
    if json_schema is not None:
        try:
            error = next(iter(_validator(json_schema).iter_errors(json.loads(text))), None)
        except ValueError as e:
            return f"the answer is not JSON ({e}): {text[:200]!r}"
        if error is None:
            return None
        return f"the answer does not satisfy the JSON schema ({error.message[:200]}): {text[:200]!r}"
    pattern = None if regex is None else _pattern(regex)
    if pattern is None or pattern.fullmatch(text):
        return None
    return f"the answer's text does not match the regex (as the tokenizer decodes its tokens): {text[:200]!r}"
