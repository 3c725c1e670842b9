"""A prefill-only request's state (``Request.task``): what its task (tasks.py) accumulates from the
forwards that compute its rows, and its result. Imports nothing of the engine, so the request can name its
type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# A prefill-only task's causal rows compute in chunks of this many tokens (fewer when the step budget is
# smaller; scheduler.py's chunk grid): where a chunk starts never depends on the batch. A chunk is taken
# whole or waits, so a step fills to within a chunk of its budget: at the CPU's budget of 512, chunks of 512
# left steps of long documents half full (1.6x slower scoring 300-1,500-token texts), chunks of 128 matched
# the unchunked engine (BENCHMARKS.md).
TASK_CHUNK = 128


@dataclass
class TaskState:
    """A prefill-only request's state (``Request.task``)."""

    kind: str  # "embed" | "classify" | "score"
    compute_from: int  # first position whose hidden state the result needs (the prefix cache stops before it)
    score_from: int = 1  # score: first scored position (its token's log-probability given those before)
    keep_token_logprobs: bool = False
    pooled: torch.Tensor | None = None  # embed: running sum (mean) or the row (cls, last); classify: logits
    logprob: float = 0.0  # score: running sum, float64
    num_scored: int = 0
    token_logprobs: list[float] = field(default_factory=list)
    result: dict[str, Any] | None = None  # the RequestOutput fields, once finished
