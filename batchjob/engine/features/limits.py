"""A constraint's say in when its request stops: a complete answer stops it, and a constraint that bounds
its own answer (choices: the longest choice) takes the place of ``max_new_tokens``, so only the context
can cut it. A choice holding a special token's text is the request's error (``stops.special_in_choices``).
"""

from __future__ import annotations

from batchjob.engine.features.base import Limits, StopRule
from batchjob.engine.features.stops import special_in_choices
from batchjob.engine.request import Request, RequestStatus


class ConstraintLimits(StopRule):
    def __init__(self, engine: Limits) -> None:
        self.engine = engine

    def limit(self, req: Request) -> int | None:
        c = req.constraint
        return c.output_limit if c is not None else None

    def error(self, req: Request) -> str | None:
        return special_in_choices(req.params.choices, self.engine.output.special_tokens)

    def stop(self, req: Request, token: int) -> RequestStatus | None:
        c = req.constraint
        if c is None:
            return None
        if c.done:
            return RequestStatus.FINISHED_STOPPED
        if c.output_limit is not None:  # it bounds the answer itself; only the context can cut it
            full = req.num_tokens >= self.engine.max_model_len
            return RequestStatus.FINISHED_LENGTH if full else RequestStatus.RUNNING
        return None
