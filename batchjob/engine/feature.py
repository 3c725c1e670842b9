"""The seam between the engine core and the request features beside it.

The core (engine.py with request, scheduler, block_manager, model_runner, sampler) runs plain requests:
admit, schedule, forward, sample, stop on EOS, stop token ids and lengths, free, report. A feature that
changes what a request samples or what it reports is a :class:`RequestFeature` the engine holds in a list,
called at a few fixed points of a step:

======================  ================================================================================
hook                    called
======================  ================================================================================
``admit``               once per new request, before the core's checks: set up the feature's slot on it
``replay``              once per resumed request that passed them: replay the output ids it brings
``before_forward``      once per step, with the requests about to sample (work that overlaps the forward)
``see_logits``          once per step, with the raw logits of the sampling rows, before any mask
``mask``                once per step, to restrict the logits before the draw
``after_sample``        once per step, with the tokens drawn (which it may replace)
``helpers``             once per finished request: requests to run before it is reported
======================  ================================================================================

Every hook takes all rows of a step at once and returns at once when no row uses the feature: the core adds
no per-token Python for a feature a step does not use. A feature keeps its per-request state in its own slot
on :class:`~.request.Request` (None when unused), typed in a leaf module, so ``request.py`` imports no feature.

The features: ``masks.Constraints`` (JSON schema, regex, choices: one bitmask row per constrained request),
``choices.ChoiceScores`` (each choice's log-probability, with helper requests for the trie nodes decoding
did not see), ``logprobs.Logprobs`` (top-K log-probabilities, and resumed tokens replayed to recompute
them); ``features/`` builds the list. What ends a request after each token is a list of stop rules
(``features/``: a constraint's own bound, end of sequence, stop strings, lengths), a prompt sampled n > 1
times is a group of plain requests sharing a prefix (``features/samples.py``), and prompt-lookup drafts are
the ``speculative.Drafter``'s (before the schedule, after it, and as tokens are verified). The prefill-only
tasks are an engine of their own (``tasks/``) that overrides the core's hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from batchjob.engine.request import Request


class RequestFeature:
    """A request feature's hooks; each does nothing here, a feature overrides the ones it needs. ``rows``:
    the requests of a step's sampling rows in order (a request verifying d drafts has d + 1 rows)."""

    def admit(self, req: Request) -> None:
        """A new request, its resumed output ids (if any) already in ``token_ids``: set up its state. A
        setting that can never work raises ``ConfigError`` (the request is then not added)."""

    def replay(self, req: Request) -> str | None:
        """A request that brings output ids from an earlier run and passed the core's checks: replay them
        through its state. Returns why they cannot be resumed (it then finishes with that error), or None."""
        return None

    def before_forward(self, rows: list[Request]) -> None:
        """The requests about to sample, one each, while the forward is about to start."""

    def see_logits(self, rows: list[Request], logits: torch.Tensor) -> None:
        """The model's logits ([rows, vocab]), before any mask."""

    def mask(self, rows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The logits the draw takes (masked rows -inf), ``logits`` itself when nothing is masked."""
        return logits

    def after_sample(self, rows: list[Request], tokens: list[int]) -> None:
        """The tokens drawn, one per row, before the requests take them: the feature may replace them in
        place, or set a request's ``error`` (it then finishes with it)."""

    def helpers(self, req: Request) -> list[Request]:
        """Requests to run (queued at the front, ``owner`` set to ``req``) before the finished ``req`` is
        reported; their logits reach ``see_logits``, their drawn tokens are dropped."""
        return []
