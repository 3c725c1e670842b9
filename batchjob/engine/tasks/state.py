"""A prefill-only request's state (``Request.task``): what its task (tasks.py) accumulates from the
forwards that compute its rows, and its result. Imports nothing of the engine, so the request can name its
type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchjob.errors import ConfigError

if TYPE_CHECKING:
    import torch


# A prefill-only task's causal rows compute in chunks of this many tokens (fewer when the step budget is
# smaller; scheduler.py's chunk grid): where a chunk starts never depends on the batch. A chunk is taken
# whole or waits, so a step fills to within a chunk of its budget: at the CPU's budget of 512, chunks of 512
# left steps of long documents half full (1.6x slower scoring 300-1,500-token texts), chunks of 128 matched
# the unchunked engine (BENCHMARKS.md).
TASK_CHUNK = 128

# A classifier's config.json ``problem_type`` -> how its outputs are read (transformers' loss and pipeline
# read them so): one label of all (softmax), each label on its own (a sigmoid per label, those above
# MULTI_LABEL_THRESHOLD), or raw values. Unset: one label of all (the raw value for one output).
HEADS = {
    None: "single",
    "single_label_classification": "single",
    "multi_label_classification": "multi",
    "regression": "regression",
}
MULTI_LABEL_THRESHOLD = 0.5  # a label applies when its sigmoid is above this (logit > 0)


def head_kind(config: Any) -> str:
    """How a sequence classifier's outputs are read: "single", "multi" or "regression" (``HEADS``); a
    ``problem_type`` batchjob does not know is refused, naming it."""
    problem = getattr(config, "problem_type", None)
    if problem not in HEADS:
        known = ", ".join(str(k) for k in HEADS if k)
        raise ConfigError(
            f"the model's config.json has problem_type {problem!r}, which batchjob does not read; it reads "
            f"{known} (or none): set one of them in config.json"
        )
    return HEADS[problem]


@dataclass
class TaskState:
    """A prefill-only request's state (``Request.task``)."""

    kind: str  # "embed" | "classify" | "score"
    compute_from: int  # first position whose hidden state the result needs (the prefix cache stops before it)
    score_from: int = 1  # score: first scored position (its token's log-probability given those before)
    keep_token_logprobs: bool = False
    pool_from: int = 0  # embed: first position the pooling takes (after a prompt left out of it)
    read_at: int = 0  # pooling "last" (embed) or a decoder's head (classify): the position read
    pooled: torch.Tensor | None = None  # embed: running sum (mean) or the row (cls, last); classify: logits
    logprob: float = 0.0  # score: running sum, float64
    num_scored: int = 0
    token_logprobs: list[float] = field(default_factory=list)
    result: dict[str, Any] | None = None  # the RequestOutput fields, once finished
