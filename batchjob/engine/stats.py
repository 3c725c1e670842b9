"""The engine's counters over its life (``Engine.stats``: the job layer's run statistics are differences
of them), and the end-of-sequence ids a model stops on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchjob.engine.scheduler import SchedulerOutput


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of every request added
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    computed_prompt_tokens: int = 0  # prompt tokens run through the model (recomputation included)
    generated_tokens: int = 0
    draft_tokens: int = 0  # prompt-lookup drafts verified
    accepted_draft_tokens: int = 0  # of which kept
    batched_tokens: int = 0  # all tokens run through the model
    running_sum: int = 0  # sum over steps of running requests (for mean occupancy)
    kv_blocks_used_sum: int = 0  # sum over steps of blocks in use (for mean KV utilization)
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    short_spin_steps: int = 0  # steps run with the spin guard on (other programs busy on our CPUs)
    max_num_seqs: int = 1
    num_blocks: int = 1

    def count_step(self, plan: SchedulerOutput, blocks_used: int, forward_seconds: float) -> None:
        """A step of ``plan`` ran, ``blocks_used`` KV blocks in use after it; ``forward_seconds`` so far."""
        self.steps += 1
        self.batched_tokens += plan.total_tokens
        self.running_sum += len(plan.requests)
        self.kv_blocks_used_sum += blocks_used
        self.forward_seconds = forward_seconds

    @property
    def mean_batch_occupancy(self) -> float:
        return self.running_sum / self.steps / self.max_num_seqs if self.steps else 0.0

    @property
    def kv_utilization(self) -> float:
        return self.kv_blocks_used_sum / self.steps / self.num_blocks if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_batch_occupancy"] = self.mean_batch_occupancy
        d["kv_utilization"] = self.kv_utilization
        return d


def eos_token_ids(model, tokenizer) -> set[int]:
    """The ids generation stops on: the generation config's ``eos_token_id`` (its generation_config.json's, or
    config.json's where the folder has no generation_config.json: transformers makes the config of it); where
    that names none, config.json's; where that names none too, the tokenizer's. transformers' ``generate``
    stops on the generation config's alone, and where it names none runs every answer to its length; these
    fallbacks stop such a model at the EOS its config or tokenizer names instead (a row ends 'stop' there)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
