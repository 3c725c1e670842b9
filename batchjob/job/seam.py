"""What the job layer uses of an engine, named: ``JobEngine``. ``batchjob.engine.Engine`` is one; the job
loop, the runner and the result columns know an engine only through these methods and attributes.

The engine's and transformers' types are imported for type checkers only: this module, like the command line,
imports no torch. Of a prefill-only engine's task runner the job reads one thing, an embedding's width
(``TaskRunner.pooling.dimensions``): ``JobTasks`` and ``JobPooling`` name exactly that. Of its LoRA adapters,
each one's name, folder and files by content as loaded (``JobAdapters``): a job's engine must hold the spec's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from batchjob.engine.config import EngineConfig
    from batchjob.engine.engine import EngineStats
    from batchjob.engine.output import RequestOutput
    from batchjob.engine.request import RequestState
    from batchjob.sampling import SamplingParams


class JobPooling(Protocol):
    """How an embed engine pools (``engine/tasks.py``'s ``Pooling``), as far as the job reads it."""

    @property
    def dimensions(self) -> int | None: ...  # the first N dimensions kept (Matryoshka); None: all

    @property
    def prompt(self) -> str: ...  # put before each text ("": none)

    @property
    def chat(self) -> str | None: ...  # each text rendered through the chat template (None: as it is)


class JobTasks(Protocol):
    """A prefill-only engine's task runner (``engine/tasks.py``'s ``TaskRunner``), as far as the job reads it."""

    @property
    def pooling(self) -> JobPooling | None: ...  # embed: how it pools; None for the other tasks


class JobAdapter(Protocol):
    """One resident LoRA adapter (``engine/lora/``'s ``Adapter``), as far as the job reads it."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path: ...  # the PEFT folder it was loaded from

    @property
    def identity(self) -> str: ...  # its files by content as they were read at load (the job records this)


class JobAdapters(Protocol):
    """An engine's resident LoRA adapters (``engine/lora/``'s ``Adapters``), as far as the job reads them."""

    @property
    def adapters(self) -> Sequence[JobAdapter]: ...


class JobEngine(Protocol):
    """The engine as a job sees it: requests in, finished outputs out, one step at a time. ``tokenizer``,
    ``model`` and ``tasks`` are read-only properties here (a job only reads them), so an engine's own, more
    specific types fit them."""

    config: EngineConfig  # the resolved options (the loop reads max_num_seqs)
    stats: EngineStats  # counters over the engine's life (the run's statistics are differences of them)
    max_model_len: int  # the longest context a generation request may have, in tokens
    prefill_limit: int  # the longest prefill-only request (embed, classify, score), in tokens
    model_id: str  # the folder the weights were loaded from ("" when not known)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...  # prompts are built and token texts decoded with it

    @property
    def model(self) -> PreTrainedModel: ...  # the Hugging Face model (its config: the embedding width)

    @property
    def tasks(self) -> JobTasks | None: ...  # the prefill-only task's runner, None for generation

    @property
    def lora(self) -> JobAdapters | None: ...  # its resident adapters (None: none)

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
        adapter: str | None = None,
        images: Any = None,
    ) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> list[RequestState]: ...

    def tokenize(self, text: str, *, special_tokens: bool = True) -> list[int]: ...

    def close(self) -> None: ...  # stops its other tensor-parallel ranks (the runner closes what it loaded)
