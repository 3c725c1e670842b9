"""Iteration-level scheduling: which requests run in the next forward, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running requests (``max_num_seqs``).
Running requests go first, in admission order: one that is decoding takes one token, one still working
through its prompt takes a chunk of what is left of the budget. Then waiting requests are admitted while
budget, seats and blocks last (skipping a request ``held`` until a sibling with the same prompt has computed
it, so it then takes those blocks from the prefix cache). Prompt chunks and decode tokens share one forward.

Admission order: requests put back at the front (preempted ones, choices' scoring requests) first; then, among the
next few waiting requests, the one with the largest ``max_new_tokens``, ties in arrival order. When output
budgets differ, the long ones start decoding early and the run does not end with one long request
decoding alone in many small steps (with equal budgets, as in a job, this is first come, first served).

How a request's next chunk is cut is a :class:`ChunkPolicy` the engine hands the scheduler: by default as
much of what is left as the budget takes (the prefill-only tasks bring their own, engine/tasks/policy.py).

When a running request needs a block and none is free, the most recently admitted running request is
preempted: its blocks are freed, its counter reset, and it goes back to the front of the queue to recompute
later. A step that preempted admits nothing new, so the pool does not thrash. Pure Python: the output is a
plain plan, and no tensor is touched here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchjob.engine.rope import LongRope


@dataclass
class SchedulerOutput:
    """The plan for one forward: ``requests[i]`` computes its next ``num_tokens[i]`` tokens."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class ChunkPolicy:
    """How many tokens a request computes next: here as much of what is left as the budget takes."""

    whole_prefix = False  # the prefix cache gives a request its reusable part only whole

    def fits(self, max_num_batched_tokens: int) -> bool:
        """Whether some chunk fits a step of this budget (else a request could never run)."""
        return True

    def chunk(self, req: Request, computed: int, budget: int, block_manager: BlockManager) -> int:
        """The tokens ``req`` computes next within ``budget`` from ``computed``; 0: it waits for a step."""
        return min(req.num_tokens - computed, budget)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        static: bool = False,
        chunks: ChunkPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.chunks = chunks or ChunkPolicy()
        assert self.chunks.fits(max_num_batched_tokens)
        # Static batching, the baseline that continuous batching replaces: once a batch has filled (or the
        # queue ran dry, or blocks ran out), nothing is admitted until every request of it has finished.
        self.static = static
        self._admitting = True
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at admission
        # A longrope model's rows (rope.py, set by the engine): each queued with its set, and computed again
        # with the long one when its output passes the switch.
        self.rope: LongRope | None = None

    def add(self, req: Request, front: bool = False) -> None:
        req.priority = front
        if self.rope is not None:
            self.rope.admit(req)
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _next_waiting(self) -> Request | None:
        """The waiting request to admit next, among those that may start now: not held for a sibling, and
        not needing a prompt prefix that a running request is computing at this moment (it will find it in
        the cache instead). Looks at most ``4 * max_num_seqs`` requests past the first that may start."""
        bm = self.block_manager
        best: Request | None = None
        seen = 0
        for req in self.waiting:
            if best is not None and seen >= 4 * self.max_num_seqs:
                break
            seen += 1
            if req.held or bm.prefix_in_flight(req):
                continue
            if req.priority:
                return req
            if best is None or req.params.max_new_tokens > best.params.max_new_tokens:
                best = req
        return best

    def schedule(self) -> SchedulerOutput:
        """The next forward's plan: running requests first, then admissions (none after a preemption)."""
        out = SchedulerOutput()
        if self.rope is not None:
            for req in self.rope.crossed(self.running):  # computed again with the long set
                self.running.remove(req)
                self._preempt(req)
                self.rope.admit(req)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if self.static and not self.running:
            self._admitting = True
        if not out.preempted and self._admitting:
            self._schedule_waiting(out, budget)
            if self.static and (not self.waiting or len(self.running) >= self.max_num_seqs):
                self._admitting = False
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Each running request's next chunk, in admission order, preempting the latest admitted when blocks
        run out. Returns the budget left."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            assert req.num_tokens > req.num_computed_tokens, (
                f"running request {req.request_id} has nothing to compute"
            )
            n = self.chunks.chunk(req, req.num_computed_tokens, budget, bm)
            if n == 0:  # its next chunk waits for a step with room for it whole
                i += 1
                continue
            while not bm.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # ``req`` itself was the last one and had to go
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests while budget, seats and blocks last, each with its cached prefix."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            if req is None:
                break
            cached = bm.match_prefix(req, whole=self.chunks.whole_prefix)
            req.num_computed_tokens = cached
            n = self.chunks.chunk(req, cached, budget, bm)
            if n == 0:
                bm.free(req)
                req.num_computed_tokens = 0
                break  # its first chunk whole, in the next step
            if not bm.allocate(req, cached + n):
                bm.free(req)
                req.num_computed_tokens = 0
                self._admitting = not self.static
                break
            self.num_cached_tokens += min(cached, req.num_prompt_tokens)
            bm.mark_in_flight(req)
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.priority = True
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a finished request out (running or waiting) and free its blocks at once."""
        assert status.is_finished
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
