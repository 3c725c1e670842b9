"""Helper requests: a request feature may ask for requests to run before a finished request is reported
(``RequestFeature.helpers``; choices: the trie nodes its decoding did not see). They run at the front of
the queue, their logits go to the features, and the owner is reported after the last of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request, RequestStatus
from batchjob.engine.scheduler import Scheduler


class Helpers:
    """Queues the helpers the features ask for and reports their owners once the last has run."""

    def __init__(
        self, requests: dict[str, Request], scheduler: Scheduler, check: Callable[[Request], str | None]
    ) -> None:
        self.requests = requests  # the engine's unfinished requests, by id
        self.scheduler = scheduler
        self.check = check  # the engine's admission check: why a request cannot run, or None

    def ready(self, req: Request, features: Sequence[RequestFeature]) -> bool:
        """Whether a finished request can be reported now: first the helper requests the features want for
        it run, at the front of the queue."""
        for feature in features:
            for helper in feature.helpers(req):
                share_forward(helper, req)  # checked as what it runs: its owner's prompt, with its images
                if self.check(helper) is not None:
                    continue  # cannot run (past the context): the feature goes without (choices: an error row)
                helper.owner = req
                req.pending_helpers += 1
                self.requests[helper.request_id] = helper
                self.scheduler.add(helper, front=True)
        return req.pending_helpers == 0

    def finish(self, helper: Request, finished: list[Request]) -> None:
        """A helper request ran (its logits went to the features); its owner is reported after the last."""
        self.scheduler.finish(helper, RequestStatus.FINISHED_STOPPED)
        del self.requests[helper.request_id]
        owner = helper.owner
        assert owner is not None and owner.pending_helpers > 0
        owner.pending_helpers -= 1
        if owner.pending_helpers == 0 and owner.request_id in self.requests:
            finished.append(owner)


def share_forward(helper: Request, owner: Request) -> None:
    """What a helper takes of its owner so that its forward is the owner's prompt's: its LoRA adapter, and
    its images (their features, rows and M-RoPE positions; shared, as a prompt's n samples share them), so
    that its image tokens are the images and not text, and its digests find the owner's blocks. A longrope
    model's set follows its length (the scheduler's admit), as for any request."""
    helper.adapter = owner.adapter
    helper.images = owner.images
