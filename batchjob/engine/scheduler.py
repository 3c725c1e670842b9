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

A chunk grid (``chunk_grid``, a prefill-only task's causal rows) makes a row's chunks a function of its
tokens alone: the part the prefix cache could hold (``BlockManager.reusable``, its ``cut``) and the rest
are each cut in chunks of ``grid`` tokens from their start, and a chunk is computed whole in one step or
waits for a step with the budget for it. A row takes its reusable part from the cache only whole, computed
by rows of the same cut (so in the same chunks). The floats a task writes then never depend on which rows
shared its steps, or on whether a restart found a prefix cached.

When a running request needs a block and none is free, the most recently admitted running request is
preempted: its blocks are freed, its counter reset, and it goes back to the front of the queue to recompute
later. A step that preempted admits nothing new, so the pool does not thrash. Pure Python: the output is a
plain plan, and no tensor is touched here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.request import Request, RequestStatus


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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        static: bool = False,
        split_prompts: bool = True,
        chunk_grid: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        # False for an encoder (rows attended both ways): a prompt runs whole in one step or waits.
        self.split_prompts = split_prompts
        self.chunk_grid = chunk_grid  # at most the token budget (or no chunk would ever fit)
        assert chunk_grid is None or 0 < chunk_grid <= max_num_batched_tokens
        # Static batching, the baseline that continuous batching replaces: once a batch has filled (or the
        # queue ran dry, or blocks ran out), nothing is admitted until every request of it has finished.
        self.static = static
        self._admitting = True
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at admission

    def add(self, req: Request, front: bool = False) -> None:
        req.priority = front
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

    def _chunk(self, req: Request, computed: int, budget: int) -> int:
        """The tokens ``req`` computes next within ``budget``: 0 when its next chunk must be whole and
        does not fit."""
        left = req.num_tokens - computed
        if not self.split_prompts:
            return left if left <= budget else 0
        if self.chunk_grid is not None:  # the grid from the start of the part it is in, to that part's end
            cut = self.block_manager.reusable(req)
            start, end = (0, cut) if computed < cut else (cut, req.num_tokens)
            whole = min(start + ((computed - start) // self.chunk_grid + 1) * self.chunk_grid, end) - computed
            return whole if whole <= budget else 0
        return min(left, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            assert req.num_tokens > req.num_computed_tokens, (
                f"running request {req.request_id} has nothing to compute"
            )
            n = self._chunk(req, req.num_computed_tokens, budget)
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

        if self.static and not self.running:
            self._admitting = True
        if not out.preempted and self._admitting:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._next_waiting()
                if req is None:
                    break
                cached = bm.match_prefix(req, whole=self.chunk_grid is not None)
                req.num_computed_tokens = cached
                n = self._chunk(req, cached, budget)
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
            if self.static and (not self.waiting or len(self.running) >= self.max_num_seqs):
                self._admitting = False
        return out

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
