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

# Keys beside ``properties`` by which an object's schema may admit keys of its own (a branch of ``allOf``, a
# ``$ref``'s properties): closing the object there would refuse them, and the schema could become
# unsatisfiable.
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "dependencies")
# As written: JSON values, not schemas; and the schemas whose matches an answer must avoid, or that only
# pick a branch (closing them would let through answers that the schema as written refuses).
_AS_WRITTEN = ("enum", "const", "default", "examples", "not", "if")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _no_extra_keys(schema: object, close: bool = True) -> object:
    """The schema with ``additionalProperties: false`` on every object that lists its properties and says
    nothing about others: the answer holds the keys the schema names (still valid against the original),
    and a model cannot pad it with keys of its own (a JSON answer near its token budget is steered to close,
    which a model that may add keys for ever can defeat). A key it requires without listing it is listed,
    with any value. Left open: an object whose schema composes others (``_COMPOSED``), and the branches of
    an ``allOf``, which name each other's keys (``close`` False)."""
    if isinstance(schema, list):
        return [_no_extra_keys(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rewrite(k, v) for k, v in schema.items()}
    props = out.get("properties")
    if (
        close
        and isinstance(props, dict)
        and not any(k in out for k in ("additionalProperties", "patternProperties", *_COMPOSED))
    ):
        required = out.get("required")
        if isinstance(required, list):
            out["properties"] = props | {k: {} for k in required if isinstance(k, str) and k not in props}
        out["additionalProperties"] = False
    return out


def _rewrite(key: str, value: object) -> object:
    """The value of ``key`` in a schema, its objects closed where ``_no_extra_keys`` closes them."""
    if key in _AS_WRITTEN:
        return value
    if key == "allOf" and isinstance(value, list):
        return [_no_extra_keys(branch, close=False) for branch in value]
    if key in _NAMED and isinstance(value, dict):  # names to schemas: a key named "not" is no keyword
        return {name: _no_extra_keys(sub) for name, sub in value.items()}
    return _no_extra_keys(value)


def _compile(kind: str, text: str) -> tuple[str, str | None]:
    """(llguidance grammar, its error or None) of a json_schema or a regex."""
    import llguidance  # an optional, heavy package: loaded when a row first asks for a grammar

    M = llguidance.LLMatcher
    grammar = ""
    try:
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        else:
            grammar = M.grammar_from_regex(text)
        error = M.validate_grammar(grammar)
    except (ValueError, RuntimeError) as e:
        error = str(e)
    return grammar, error if error and not error.startswith("WARNING") else None


def grammar_of(json_schema: str | None, regex: str | None) -> tuple[str, str, str]:
    """(kind, text, llguidance grammar) of a json_schema or else a regex; raises ConfigError if invalid. A
    schema compiles with its objects closed to keys it does not name (``_no_extra_keys``); where that makes
    one llguidance refuses (one that closing leaves no answer), it compiles as written."""
    if json_schema is not None:
        kind, text = "json_schema", json_schema
        try:
            schema = json.loads(text)
            closed = json.dumps(_no_extra_keys(schema))
        except ValueError:
            schema, closed = None, text  # not JSON: llguidance says why
        _refuse_dialect_gaps(schema)
        grammar, error = _compile(kind, closed)
        if error is not None:
            grammar, error = _compile(kind, text)
    else:
        assert regex is not None
        kind, text = "regex", regex
        _refuse_gap("regex", regex)
        grammar, error = _compile(kind, text)
    if error is not None:
        raise ConfigError(f"{kind} could not be compiled: {' '.join(error.split())}; got {text[:200]!r}")
    return kind, text, grammar


def _refuse_gap(what: str, regex: str, schema: bool = False) -> None:
    gap = _dialect_gap(regex, schema)
    if gap is not None:
        raise ConfigError(
            f"{what} {regex[:200]!r} reads differently in llguidance, which writes the answer, and in "
            f"Python's re, which checks it: {gap}"
        )


def _refuse_dialect_gaps(schema: object, where: str = "json_schema") -> None:
    """``_refuse_gap`` for every ``pattern`` and ``patternProperties`` key of a schema (jsonschema checks
    them with Python's re, as the regex's answers are checked)."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            _refuse_dialect_gaps(sub, f"{where}[{i}]")
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            _refuse_gap(f"{where}.pattern", value, schema=True)
        elif key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                _refuse_gap(f"{where}.patternProperties key", pattern, schema=True)
        if key not in _AS_WRITTEN or key in ("not", "if"):
            _refuse_dialect_gaps(value, f"{where}.{key}")


# A group that sets flags: (?x), (?i-x), (?x: ... ); its flags turned on, off, and ')' (to the enclosing
# group's end) or ':' (this group's).
_FLAGS = re.compile(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?([:)])")
_PYTHON_SPACE = " \v\f"  # the whitespace both ignore in verbose mode (a tab, \n, \r: llguidance reads them)


def _dialect_gap(regex: str, schema: bool = False) -> str | None:
    """Where llguidance (Rust's regex syntax) and Python's re read a regex differently, in words; else None.
    Inside [...], Rust reads an unescaped '[' as a nested class or a POSIX class ([:alpha:]) and '&&', '--',
    '~~' as set operations; Python reads them as literal characters (a set, then a literal ']'): the answers
    would fail Python's check, every row an error blaming the tokenizer. In verbose mode ((?x)) a comment
    ('#' to the line's end) is read by neither, and the whitespace the two ignore differs (``_verbose_gap``).
    ``schema``: a JSON schema's pattern, where llguidance's \\d is ASCII (``_class_gap``)."""
    i, in_set, verbose, groups = 0, False, False, []  # groups: each open group's verbose mode outside it
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            gap = _class_gap(regex[i + 1 : i + 2], i, schema)
            if gap is not None:
                return gap
            i += 2
            continue
        if in_set:
            gap = _set_gap(regex, i, verbose)
            if gap is not None:
                return gap
            in_set = ch != "]"
        elif verbose and (ch == "#" or ch.isspace()):
            gap = _verbose_gap(ch, i)
            if gap is not None:
                return gap
            if ch == "#":  # a comment, to the line's end (a line break is itself refused above)
                i = len(regex) if (end := regex.find("\n", i)) < 0 else end
                continue
        elif ch == "[":
            in_set, i = True, i + 1
            i += regex.startswith("^", i)
            i += regex.startswith("]", i)  # a first ']' is a literal in both
            continue
        elif ch == "(":
            groups.append(verbose)
            flags = _FLAGS.match(regex, i)
            if flags is not None:
                on, off, scope = flags.groups()
                verbose = ("x" in on or verbose) and "x" not in (off or "")
                if scope == ")":  # (?x): to the end of the enclosing group
                    groups.pop()
                i = flags.end()
                continue
        elif ch == ")" and groups:
            verbose = groups.pop()
        i += 1
    return None


def _class_gap(letter: str, i: int, schema: bool) -> str | None:
    """A class escape (the letter after a backslash at position ``i``) the two read differently, and how to
    go on; or None. Measured over the BMP with llguidance 1.9 and Python 3.11: \\w takes 1,410 characters
    more in llguidance (combining marks: a Hindi or Thai word, a decomposed accent; answers then failed
    Python's check) and 300 fewer (², ½); in a schema's pattern llguidance reads \\w and \\d as ASCII (as
    JSON Schema's ECMA-262 does): every answer it writes then passes Python's check, so they are taken, but
    their complements \\W and \\D are wider there than Python's ('é', '٣' written, then failed). \\d of a
    regex agrees (Unicode digits in both); \\s differs only by the separators U+001C-U+001F, which Python's
    takes."""
    if not letter or letter not in ("WD" if schema else "wW"):
        return None
    word = letter in "wW"
    ascii_class, more = ("[A-Za-z0-9_]", "letters (À-ÿ)") if word else ("[0-9]", "digits (٠-٩)")
    if schema:
        kind = "word characters" if word else "digits"
        reading = f"\\{letter} takes all but {ascii_class} in llguidance, all but Unicode's {kind} in Python's re"
    else:
        reading = "\\w takes combining marks and not ² or ½ in llguidance, the reverse in Python's re"
    spelled = f"[^{ascii_class[1:-1]}]" if letter.isupper() else ascii_class
    return f"the class \\{letter} at position {i} ({reading}); spell it out: {spelled}, adding the {more} you mean"


def _set_gap(regex: str, i: int, verbose: bool) -> str | None:
    """A dialect gap at ``regex[i]`` inside [...] (``_dialect_gap``), and how to go on; or None."""
    ch, fix = regex[i], "; write the class out ([A-Za-z] for [[:alpha:]]) or escape the character (\\[)"
    if ch == "[":
        posix = re.match(r"\[:\^?([a-z]+):\]", regex[i:])
        what = f"the POSIX class {posix.group(0)}" if posix else "a nested set"
        return f"{what} at position {i} (Python: a literal '[' in a set){fix}"
    if regex[i : i + 2] in ("&&", "--", "~~"):
        return f"the set operation {regex[i : i + 2]!r} at position {i} (Python: literal characters){fix}"
    if verbose and (ch == "#" or ch.isspace() and ch not in "\t\n\r"):  # (those 3 are the character in both)
        rust = "a comment to the line's end" if ch == "#" else "ignored"
        return (
            f"the {ch!r} in a set at position {i} in verbose mode (llguidance: {rust}; Python: the character "
            f"itself); escape it ({_escaped(ch)})"
        )
    return None


def _verbose_gap(ch: str, i: int) -> str | None:
    """A dialect gap at whitespace ``ch`` outside a set in verbose mode, and how to go on; or None: llguidance
    reads a tab or a line break as the character itself (so a comment before a line break runs to the
    regex's end, the next lines with it), and ignores non-ASCII whitespace (a no-break space), which Python
    reads as the character."""
    if ch == "#" or ch in _PYTHON_SPACE:
        return None
    if ch in "\t\n\r":
        return (
            f"the {ch!r} at position {i} in verbose mode (llguidance: the character itself, and a comment "
            "before it runs to the regex's end; Python: ignored); write the regex on one line, laid out with "
            f"spaces ({_escaped(ch)} where the character is meant)"
        )
    return (
        f"the {ch!r} at position {i} in verbose mode (llguidance: ignored; Python: the character itself); "
        f"write it as {_escaped(ch)} where it is meant, else as a space"
    )


def _escaped(ch: str) -> str:
    """``ch`` escaped as both dialects read it in verbose mode: ``\\#``, ``\\ ``, ``\\t``, ``\\u00a0``."""
    if ch in "# ":
        return "\\" + ch
    return {"\t": "\\t", "\n": "\\n", "\r": "\\r"}.get(ch, f"\\u{ord(ch):04x}")


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
    return (
        f"the answer's text does not match the regex as Python's re reads it: {text[:200]!r} (the grammar "
        "wrote it token by token: a tokenizer's decoding may differ from its tokens, and llguidance's \\S "
        "takes the separators U+001C-U+001F, Python's not)"
    )
