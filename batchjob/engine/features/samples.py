"""A prompt sampled n > 1 times: n plain requests sharing a prefix. Each has its own id (``request#k``)
and sampler key; the first computes the prompt and the others wait for it (the engine sets ``wait_for``),
then take its KV blocks from the prefix cache. Resuming one sample re-adds only it (``sample_index``).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine.request import request_key
from batchjob.errors import ConfigError


@dataclass(frozen=True)
class Sample:
    request_id: str  # the engine's id of this sample
    index: int  # k of n
    key: int | None  # its sampler key; None: derived from ``request_id``


def samples(request_id: str, n: int, key: int | None, sample_index: int | None) -> list[Sample]:
    """The requests a prompt's n samples become (one: the request itself)."""
    if n == 1:
        return [Sample(request_id, 0, key)]
    if sample_index is not None and not 0 <= sample_index < n:
        raise ConfigError(f"sample_index must be in [0, {n}), got {sample_index!r}")
    indices = range(n) if sample_index is None else [sample_index]
    return [Sample(f"{request_id}#{k}", k, _sub_key(key, k)) for k in indices]


def _sub_key(key: int | None, k: int) -> int | None:
    """Sample k's sampler key: derived from the request's key, or (None) from its own id."""
    return None if key is None else request_key(f"{key}#{k}")
