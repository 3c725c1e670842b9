"""What a row kind is: a row between admission and its result rows, which says what engine requests it makes
(``Ask``), what each finished request turns into (a follow-up request, or once all are done the row's result
rows) and what of it an in-flight checkpoint saves.

The job loop routes every finished request back to its row through one table, from the engine's request id
to the row and the ``part`` the row gave that request (``loop.py``); nothing reads meaning out of an id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput
    from batchjob.engine.request import RequestState
    from batchjob.io.readers import Row
    from batchjob.job.checkpoint import InFlight
    from batchjob.sampling import SamplingParams


@dataclass(frozen=True)
class Ask:
    """One request a row asks the engine for (``JobEngine.add_request``'s arguments), and which of the row's
    requests it is."""

    request_id: str  # the engine's id; for a sampled request also its seeded sampler's key
    prompt_ids: list[int]
    params: SamplingParams | None = None  # None: a prefill-only request (the task's own)
    output_ids: list[int] | None = None  # resumed: the tokens the last checkpoint saved
    sample_index: int | None = None  # --n, resumed: only this sample (None: all n)
    continuation_ids: list[int] | None = None  # --task score: the scored text's ids
    token_logprobs: bool = False  # --task score: keep each scored token's log-prob
    part: int | None = None  # the row's own index for it (an answer's sample, an input); None: the output's


ENGINE_FAILURE = "the engine could not run this request"  # an error the engine gave no words for


def request_error(out: RequestOutput) -> str | None:
    """A finished request's error (None when it ran), with a message when the engine gave none."""
    if out.finish_reason != "error":
        return None
    return out.error if out.error is not None else ENGINE_FAILURE


def refused_outputs(ask: Ask, error: str) -> list[RequestOutput]:
    """The outputs of a request the engine refused at admission (``add_request`` raised ``ConfigError``: a
    label set or grammar of the row's own it can't run), each sample's an error, as the engine reports a
    request it can't run: the row is then written with the error, and the job goes on."""
    from batchjob.engine.output import RequestOutput  # (the engine's type: the engine is loaded by now)

    n = ask.params.n if ask.params is not None else 1
    indices = [0] if n == 1 else [ask.sample_index] if ask.sample_index is not None else list(range(n))
    now = time.monotonic()
    return [
        RequestOutput(
            ask.request_id, list(ask.prompt_ids), [], "", "error", error, now, None, now, sample_index=k
        )
        for k in indices
    ]


@dataclass(eq=False)
class RowWork:
    """A row in flight. ``finished`` records a request's output and returns the requests that follow it
    (then the output is a step of the row, not one of its results); once ``done``, ``results`` are the row's
    result rows, one per sample (by ``sample_index``)."""

    kind: ClassVar[str]
    row: Row
    row_id: str  # the engine's and the sampler's id of the row (--id-column, else derived)
    prompt_ids: list[int]  # of its first request; its length orders admission
    num_prompt_tokens: int
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # finished results by sample or input
    request_ids: list[str] = field(default_factory=list)  # every engine id it was given (the loop's routes)
    adapter: str | None = None  # the LoRA adapter its requests run under (None: the base model; adapter.py)
    images: Any = None  # the processor's image outputs its requests carry (None: text only; images.py)
    num_images: int = 0

    def asks(self) -> list[Ask]:
        """The requests the row makes when it enters the engine."""
        raise NotImplementedError

    def finished(self, out: RequestOutput, part: int | None) -> list[Ask]:
        """Record a finished request (``part``: the one its ``Ask`` gave); the requests that follow it."""
        self.outputs[out.sample_index if part is None else part] = out
        return []

    @property
    def expected(self) -> int:
        """How many results the row has (samples, or inputs)."""
        return 1

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.expected

    def results(self) -> list[dict[str, Any]]:
        """The row's result rows, by sample (``generated_text`` or the task's columns, and the rest)."""
        return [self.result(k, self.outputs[k]) for k in sorted(self.outputs)]

    def result(self, k: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, saved: InFlight | None) -> None:
        """Take the last checkpoint's work on this row, when it is this row's (by default there is none)."""

    @property
    def restored_tokens(self) -> int:
        """Generated tokens it took from the last checkpoint (an earlier run's work, not this run's)."""
        return 0

    def in_flight(self, states: list[tuple[int | None, RequestState]]) -> InFlight | None:
        """What a checkpoint saves of the row: its requests in the engine (``states``, with their parts), or
        with none, what it restored and has not yet given the engine. None: nothing (it is computed again)."""
        return None
