"""The stop check's hook: after each token a request takes, its rules are asked in order and the first
with a verdict decides (``RUNNING``: it goes on, and no later rule is asked). A rule may also bound how
many tokens a request can generate, which the admission check sizes its KV blocks by.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchjob.engine.output import OutputProcessor
    from batchjob.engine.request import Request, RequestStatus


class Limits(Protocol):
    """What the stop rules read of the engine, read at each check (a test may set another EOS)."""

    eos_token_ids: set[int]  # the ids generation stops on
    max_model_len: int  # the context, in tokens
    output: OutputProcessor  # text: the stop strings are looked for in it


class StopRule:
    """One rule of the stop check; each hook does nothing here, a rule overrides the ones it needs."""

    def limit(self, req: Request) -> int | None:
        """The output tokens this rule bounds ``req`` to, instead of ``max_new_tokens``; None: no bound."""
        return None

    def error(self, req: Request) -> str | None:
        """Why this rule could never act as ``req`` asks (its error at admission), or None."""
        return None

    def stop(self, req: Request, token: int) -> RequestStatus | None:
        """After ``req`` took ``token``: a finished status, ``RUNNING`` (not finished, and no later rule
        asked), or None (the next rule decides)."""
        return None
