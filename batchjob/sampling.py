"""Sampling parameters for one request."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchjob.engine.grammar import grammar_of
from batchjob.errors import ConfigError
from batchjob.io.jsontext import RefusedText, loads_text

SEED_MODULUS = 2**64
MAX_N = 10_000  # samples of one row: each is a request in the engine, so one row can't flood it
MIN_TEMPERATURE = 1e-3  # below it (but above 0, greedy) logits / temperature overflows float32

# The one check of every numeric sampling value, whatever its source (command line, job file, a row's
# params column, an OpenAI request body): name -> (integer?, in range?, the rule as the message says it).
NUMBERS: dict[str, tuple[bool, Callable[[float], bool], str]] = {
    "max_new_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "temperature": (
        False,
        lambda v: v == 0 or v >= MIN_TEMPERATURE,
        f"a finite number, 0 (greedy) or >= {MIN_TEMPERATURE}",
    ),
    "top_k": (True, lambda v: v >= 0, "an integer >= 0 (0 disables it)"),
    "top_p": (False, lambda v: 0.0 < v <= 1.0, "a finite number in (0, 1]"),
    "min_p": (False, lambda v: 0.0 <= v <= 1.0, "a finite number in [0, 1]"),
    "seed": (True, lambda v: v >= 0, "an integer >= 0 (of any size: it is taken modulo 2**64)"),
    "logprobs": (True, lambda v: 0 <= v <= 100, "an integer in [0, 100]"),
    "n": (True, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
    "repetition_penalty": (False, lambda v: v > 0, "a finite number > 0 (1 is none)"),
}


def check_number(name: str, value: Any) -> str | None:
    """Why ``value`` is not a valid ``name`` (the message names both), or None: finite, in range, an integer
    where it must be (a bool is not a number, 2.0 is not an integer, 1e999 and NaN are not finite)."""
    integer, in_range, rule = NUMBERS[name]
    shown = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**60
        else f"an integer of {len(str(abs(value)))} digits"
    )
    wrong = f"{name} must be {rule}, got {shown[:200]}"
    if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
        return wrong
    if not integer:
        try:
            value = float(value)  # an int too large for a float is not a usable number either
        except OverflowError:
            return wrong
        if not math.isfinite(value):
            return wrong
    return None if in_range(value) else wrong


def greedy_samples(n: int, temperature: float) -> str | None:
    """Why ``n`` samples at ``temperature`` are refused (as vLLM refuses them: n copies of one answer, as
    samples), or None."""
    if n > 1 and temperature == 0:
        return (
            f"n={n} with temperature 0 (greedy) gives {n} identical answers: give a temperature above 0 for "
            "samples, or n 1"
        )
    return None


# The fields that shape a draw at a temperature above 0, each with its value that leaves it off: greedy
# decoding (temperature 0) draws nothing, and so takes none of them.
DRAW_ONLY: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}


def draw_only_given(values: dict[str, Any]) -> list[str]:
    """The draw-only fields ``values`` sets (a value other than the one that leaves it off), in order."""
    return [k for k, off in DRAW_ONLY.items() if values.get(k) is not None and values[k] != off]


def _check_no_replacement_character(stops: list[str]) -> None:
    """A stop string holding U+FFFD is refused: the output's text shows U+FFFD for a character whose bytes
    have not all been generated yet, so it ended a row at the first byte of any character of several bytes
    ('é€😀yz' was answered '', finish_reason 'stop')."""
    held = next((s for s in stops if "\ufffd" in s), None)
    if held is not None:
        raise ConfigError(
            f"stop string {held!r} holds U+FFFD (the replacement character), which the text shows while a "
            "character of several bytes (é, €, an emoji) is not yet whole: it would end the answer at any "
            "such character's first byte; leave it out"
        )


def map_seed(seed: int) -> int:
    """A seed of any size as the sampler uses it: ``seed mod 2**64``. Seeds already in
    [0, 2**64) are unchanged, and the rule is fixed, so a resumed job draws what it drew before."""
    return seed % SEED_MODULUS


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable their filters.
    With a ``seed``, the random draw for the token at output position ``p`` depends only on
    (seed, request id, p): a request's tokens do not depend on its neighbours in a batch, on preemption or on
    a restart. Without one, the engine draws a seed when the request is added.

    Constraints (at most one): ``choices`` (the answer is exactly one of these strings; the output also
    gives each choice's log-probability; ``max_new_tokens`` does not apply), ``json_schema`` (a schema as
    a dict or JSON text; the answer is compact JSON valid against it) or ``regex`` (the answer matches it).
    ``logprobs=K`` returns the top-K log-probabilities of each generated token (plus the sampled token's
    when it is not among them). ``n`` draws that many samples of the prompt, which computes its KV once.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    choices: list[str] | None = None
    json_schema: str | None = None  # canonical JSON text (a dict is accepted and serialized)
    regex: str | None = None
    logprobs: int | None = None  # top-K per generated token; None: off
    n: int = 1
    repetition_penalty: float | None = None  # None: the model's (its generation config's), else 1 (off)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.ignore_eos, bool):  # "false" or 1 would read as true
            raise ConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in NUMBERS:
            value = getattr(self, name)
            if type(value).__module__ == "numpy" and hasattr(value, "item"):  # np.int64(4): Python's 4
                value = value.item()
                setattr(self, name, value)
            if value is None and name in ("seed", "logprobs", "repetition_penalty"):
                continue
            problem = check_number(name, value)
            if problem:
                raise ConfigError(problem)
        if self.seed is not None:
            self.seed = map_seed(self.seed)
        if self.stop is not None:
            # a dict or set is no list: its keys (in no promised order) are not what was meant
            if not isinstance(self.stop, (list, tuple)) or any(
                not isinstance(s, str) or s == "" for s in self.stop
            ):
                raise ConfigError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
            self.stop = list(self.stop)
            _check_no_replacement_character(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**63 for t in ids
            ):
                raise ConfigError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
            self.stop_token_ids = list(ids)
        problem = greedy_samples(self.n, self.temperature)
        if problem:
            raise ConfigError(problem)
        self._check_constraints()

    def _check_constraints(self) -> None:
        if isinstance(self.choices, str):
            raise ConfigError(f"choices must be a list of strings, got the string {self.choices!r}")
        if self.choices is not None:
            choices = self.choices  # a dict or set is refused: its keys, in no promised order, are not a list
            if (
                not isinstance(choices, (list, tuple))
                or not choices
                or any(not isinstance(c, str) or c == "" for c in choices)
            ):
                raise ConfigError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
            self.choices = list(choices)
            if len(set(self.choices)) != len(self.choices):
                raise ConfigError(f"choices must be distinct, got {self.choices!r}")
        if self.json_schema is not None:
            schema = self.json_schema
            try:
                if isinstance(schema, str):
                    schema = loads_text(schema)  # a key given twice is refused, as in a JSONL line
                if not isinstance(schema, (dict, bool)):
                    raise ConfigError(
                        f"json_schema must be a JSON object, got {str(self.json_schema)[:200]!r}"
                    )
                self.json_schema = json.dumps(
                    schema, separators=(",", ":")
                )  # key order kept: it orders the output
            except (ValueError, RecursionError) as e:
                if isinstance(e, ConfigError):
                    raise
                if isinstance(e, RefusedText):
                    raise ConfigError(f"json_schema: {e}") from e
                why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
                raise ConfigError(
                    f"json_schema is not valid JSON ({why}), got {str(self.json_schema)[:200]!r}"
                ) from e
        if self.regex is not None and (not isinstance(self.regex, str) or self.regex == ""):
            raise ConfigError(f"regex must be a non-empty string, got {self.regex!r}")
        given = [n for n in ("choices", "json_schema", "regex") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"choices, json_schema and regex exclude each other, got {' and '.join(given)}")
        if given:
            self._check_no_stop_under(given[0])
        if self.json_schema is not None or self.regex is not None:
            # a schema or regex the grammar library cannot compile fails here, early
            grammar_of(self.json_schema, self.regex)

    def _check_no_stop_under(self, constraint: str) -> None:
        """A stop string or token ends the answer wherever it comes; a constraint ends it only where the answer
        is complete. Under a schema or a regex the pair gave a cut answer (``{``) as a finished one, so it is
        refused; a choice is always written whole (a stop inside it was ignored), so a stop string is refused
        there only where a choice holds it (``--stop '\\n'`` beside one-word choices stays harmless)."""
        if self.stop_token_ids:
            raise ConfigError(
                f"stop_token_ids and {constraint} exclude each other (got {self.stop_token_ids!r}): a stop token "
                "would cut the constrained answer short; give one of them"
            )
        if not self.stop:
            return
        if constraint != "choices":
            raise ConfigError(
                f"stop and {constraint} exclude each other (got stop {self.stop!r}): a stop string would cut "
                "the constrained answer short; give one of them"
            )
        held = [(c, s) for c in self.choices or () for s in self.stop if s in c]
        if held:
            raise ConfigError(
                f"stop and choices exclude each other: the choice {held[0][0]!r} holds the stop string "
                f"{held[0][1]!r}, and a choice is always written whole; drop the stop string or change the choice"
            )

    @property
    def constrained(self) -> bool:
        return self.choices is not None or self.json_schema is not None or self.regex is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field, except the constraint and sample fields left at their defaults (so the dict, and
        the fingerprint of a job made from it, is what it was before those fields existed)."""
        d = dataclasses.asdict(self)
        for name in ("choices", "json_schema", "regex", "logprobs", "repetition_penalty"):
            if d[name] is None:
                del d[name]
        if d["n"] == 1:
            del d["n"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
