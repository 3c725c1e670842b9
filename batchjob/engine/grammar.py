"""A JSON schema or regex compiled to an llguidance grammar, and checked: the one place that knows how.

``SamplingParams`` checks a request's grammar with it when the request is made (so a bad one fails early);
the engine's constraints (:mod:`.constraints`) compile the same grammar for a tokenizer. It imports nothing of
either, so both import it.
"""

from __future__ import annotations

import json

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
