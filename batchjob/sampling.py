"""Sampling parameters for one request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchjob.errors import ConfigError


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable their filters.
    With a ``seed``, the random draw for the token at output position ``p`` depends only on
    (seed, request id, p): a request's tokens do not depend on its neighbours in a batch, on preemption or on
    a restart. Without one, the engine draws a seed when the request is added.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
