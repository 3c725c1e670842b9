"""A constraint's say in when its request stops: a complete answer stops it, and a constraint that bounds
its own answer (choices: the longest choice) takes the place of ``max_new_tokens``, so only the context
can cut it.
"""

from __future__ import annotations

from batchjob.engine.features.base import Limits, StopRule
from batchjob.engine.request import Request, RequestStatus


class ConstraintLimits(StopRule):
    def __init__(self, engine: Limits) -> None:
        self.engine = engine

    def limit(self, req: Request) -> int | None:
        c = req.constraint
        return c.output_limit if c is not None else None

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
