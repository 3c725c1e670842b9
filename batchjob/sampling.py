"""Sampling parameters for one request."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from batchjob.engine.grammar import grammar_of
from batchjob.errors import ConfigError


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.stop is not None:
            if any(not isinstance(s, str) or s == "" for s in self.stop):
                raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r}")
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self._check_constraints()

    def _check_constraints(self) -> None:
        if isinstance(self.choices, str):
            raise ConfigError(f"choices must be a list of strings, got the string {self.choices!r}")
        if self.choices is not None:
            self.choices = list(self.choices)
            if not self.choices or any(not isinstance(c, str) or c == "" for c in self.choices):
                raise ConfigError(
                    f"choices must be a non-empty list of non-empty strings, got {self.choices!r}"
                )
            if len(set(self.choices)) != len(self.choices):
                raise ConfigError(f"choices must be distinct, got {self.choices!r}")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ConfigError(
                        f"json_schema is not valid JSON ({e}), got {self.json_schema[:200]!r}"
                    ) from e
            if not isinstance(schema, (dict, bool)):
                raise ConfigError(f"json_schema must be a JSON object, got {self.json_schema!r}")
            self.json_schema = json.dumps(
                schema, separators=(",", ":")
            )  # key order kept: it orders the output
        if self.regex is not None and (not isinstance(self.regex, str) or self.regex == ""):
            raise ConfigError(f"regex must be a non-empty string, got {self.regex!r}")
        given = [n for n in ("choices", "json_schema", "regex") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"choices, json_schema and regex exclude each other, got {' and '.join(given)}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= 100
        ):
            raise ConfigError(f"logprobs must be an integer in [0, 100], got {self.logprobs!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {self.n!r}")
        if self.json_schema is not None or self.regex is not None:
            # a schema or regex the grammar library cannot compile fails here, early
            grammar_of(self.json_schema, self.regex)

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
        for name in ("choices", "json_schema", "regex", "logprobs"):
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
