"""What the job layer uses of an engine, named: ``JobEngine``. ``batchjob.engine.Engine`` is one; the job
loop, the runner and the result columns know an engine only through these methods and attributes.

The engine's types are imported for type checkers only: this module, like the command line, imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from batchjob.engine.config import EngineConfig
    from batchjob.engine.engine import EngineStats, RequestState
    from batchjob.engine.output import RequestOutput
    from batchjob.sampling import SamplingParams


class JobEngine(Protocol):
    """The engine as a job sees it: requests in, finished outputs out, one step at a time."""

    tokenizer: Any  # a Hugging Face tokenizer: prompts are built and token texts decoded with it
    config: EngineConfig  # the resolved options (the loop reads max_num_seqs)
    stats: EngineStats  # counters over the engine's life (the run's statistics are differences of them)
    max_model_len: int  # the longest context a generation request may have, in tokens
    prefill_limit: int  # the longest prefill-only request (embed, classify, score), in tokens
    model_id: str  # the folder the weights were loaded from ("" when not known)
    model: Any  # the Hugging Face model (its config: the embedding width)
    tasks: Any  # the prefill-only task's runner (embed: its pooling), None for generation

    @property
    def num_unfinished(self) -> int: ...

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        output_ids: Sequence[int] | None = None,
        *,
        sample_index: int | None = None,
        continuation_ids: Sequence[int] | None = None,
        token_logprobs: bool = False,
    ) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> list[RequestState]: ...

    def tokenize(self, text: str, *, special_tokens: bool = True) -> list[int]: ...
