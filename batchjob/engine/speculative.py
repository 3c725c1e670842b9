"""Speculative decoding by prompt lookup: draft tokens copied from the request's own context.

When the last few tokens of a decoding request (an n-gram, 3 tokens, else 2) occurred earlier in its prompt
or output, the tokens that followed them there are proposed as its next ones. The forward then computes the
request's last token and the drafts together, as one chunk of ``1 + k`` tokens; the sampler draws a token at
every position of the chunk, and the drafts are kept while each equals the token drawn before it. A token's
draw depends only on the logits and (seed, request, position), greedy or sampled, so the output is the one
that decoding a token at a time gives (up to the float rounding of a different batch shape), in fewer
forwards when the output repeats its context: extraction, summaries, code, and the loops that small models
fall into.

Drafts live only inside one ``Engine.step()``: proposed before scheduling, trimmed to what the scheduler
gave the request, resolved after sampling. A checkpoint or a preemption never sees them.

Drafting must pay for itself. A draft costs a row of the forward whether it is kept or not; a kept one saves
its request a step. ``Drafter`` fits each step's seconds to its rows over the recent steps (a fixed cost, a
cost per prompt token, a cost per sampled row: a decode or a draft) and drafts a request's ``j``-th token
only while the chance that it is kept (``p ** j``, ``p`` the request's own rate of kept drafts, starting from
the engine's) beats ``outputs * row / step``: a kept draft must add more to the step's tokens than its row
adds to the step's time. A full batch of a small model on a CPU (rows dear) then drafts only for requests
that copy their context; a few requests in the tail, or a GPU (rows nearly free), draft freely. A step
whose prompt chunks fill the token budget takes no drafts: they would only push prompt tokens to a later
step. Once no request waits for a seat, the run ends with its longest request: for the requests with at
least half the longest one's budget left, a kept draft saves a whole step, and the bar is ``row / step``.
These are decisions about time, never about the output: kept drafts are the tokens that decoding one at a
time draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.ngram import KeptRate, SpecState
from batchjob.engine.request import Request, RequestStatus
from batchjob.engine.scheduler import Scheduler, SchedulerOutput

ENGINE_DECAY = 0.98  # the engine's (every request's), likewise
PROBE_STEPS = 32  # a request whose drafts don't pay still tries one this often (its text may start to loop)
FIT_DECAY = 0.95  # the step-cost fit's memory, per step (about the last 20 steps)
# A step's fixed cost in rows' worth (alpha / beta), until the fit has steps of different sizes. The embedded
# model on 2 CPU cores: ~50 ms a step + ~4 ms a decode row (~350 keys), 12. A GPU: rows are nearly free until
# a step is compute-bound.
PRIOR_STEP_ROWS = {"cpu": 12.0, "cuda": 256.0}
PRIOR_PROMPT_SHARE = 0.5  # a prompt token's cost against a sampled row's, likewise


class StepCost:
    """A step's seconds as ``alpha + beta_prompt * prompt_rows + beta_row * sampled_rows``: least squares
    over the recent steps (faded). A sampled row (a decode or a draft: attention over the request's whole
    context, and the output head) costs more than a prompt token. Until the steps seen tell the three
    apart, the device's prior."""

    def __init__(self, prior_step_rows: float) -> None:
        self.prior = (prior_step_rows, PRIOR_PROMPT_SHARE, 1.0)  # in units of beta_row
        self.s = [[0.0] * 3 for _ in range(3)]  # faded sums of v v^T, v = (1, prompt_rows, sampled_rows)
        self.b = [0.0] * 3  # faded sums of v * seconds

    def observe(self, prompt_rows: int, sampled_rows: int, seconds: float) -> None:
        v = (1.0, float(prompt_rows), float(sampled_rows))
        for i in range(3):
            self.b[i] = FIT_DECAY * self.b[i] + v[i] * seconds
            for j in range(3):
                self.s[i][j] = FIT_DECAY * self.s[i][j] + v[i] * v[j]

    def coefficients(self) -> tuple[float, float, float]:
        """``(alpha, beta_prompt, beta_row)`` in units of ``beta_row`` (only their ratios matter)."""
        if self.s[0][0] < 4:
            return self.prior
        fit = _solve(self.s, self.b, [0, 1, 2])
        if fit is None:  # no prompt rows lately (or always the same share): decode steps alone
            two = _solve(self.s, self.b, [0, 2])
            fit = None if two is None else (two[0], self.prior[1] * two[1], two[1])
        if fit is None or fit[0] <= 0 or fit[1] < 0 or fit[2] <= 0:
            return self.prior
        alpha, beta_prompt, beta_row = fit
        return min(alpha / beta_row, 4096.0), beta_prompt / beta_row, 1.0

    def threshold(self, outputs: int, prompt_rows: int, sampled_rows: int) -> float:
        """The chance of being kept that a draft needs to pay in a step of these rows that makes
        ``outputs`` tokens: a kept draft is one more token for the step, a row more of its cost, so
        ``(outputs + 1) / (step + row) > outputs / step`` when the chance exceeds ``outputs * row / step``."""
        alpha, beta_prompt, beta_row = self.coefficients()
        return outputs * beta_row / (alpha + beta_prompt * prompt_rows + beta_row * sampled_rows)


def _solve(s: list[list[float]], b: list[float], idx: list[int]) -> tuple[float, ...] | None:
    """Least squares from the normal equations restricted to ``idx`` (Gaussian elimination); None when
    they are near singular (a regressor that did not vary)."""
    n = len(idx)
    a = [[s[i][j] for j in idx] + [b[i]] for i in idx]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-9 * max(1.0, max(abs(a[i][i]) for i in range(n))):
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(n):
            if r != c:
                f = a[r][c] / a[c][c]
                for k in range(c, n + 1):
                    a[r][k] -= f * a[c][k]
    return tuple(a[i][n] / a[i][i] for i in range(n))


def can_draft(req: Request) -> bool:
    """Decoding, and nothing that needs the model's distribution token by token (constraints, log-probs
    and their replayed tokens, helper requests such as choices' scoring requests). A prefill-only task's
    row never decodes, even when one token of it is left to compute."""
    return (
        req.num_computed_tokens == req.num_tokens - 1
        and req.task is None
        and req.constraint is None
        and req.logprobs is None
        and req.owner is None
        and req.penalty is None  # each drafted position would need its own context's penalty
    )


def window(p: float, threshold: float, k: int) -> int:
    """How many drafts pay, at most ``k``: the ``j``-th is kept with chance ``p ** j``, which must beat
    ``threshold``."""
    j, chance = 0, p
    while j < k and chance > threshold:
        j += 1
        chance *= p
    return j


def record(req: Request, proposed: int, kept: int) -> None:
    """A request's verified drafts: ``kept`` of ``proposed``."""
    if req.spec is None:
        req.spec = SpecState()
    req.spec.kept.add(proposed, kept)


class Drafter:
    """Proposes each step's drafts (``draft``) where they pay (see the module's docstring), and learns from
    the steps' times (``observe``) and the drafts' fate (``record``)."""

    def __init__(self, max_drafts: int, device: str, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.max_drafts = max_drafts
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.cost = StepCost(PRIOR_STEP_ROWS.get(device, PRIOR_STEP_ROWS["cpu"]))
        self.kept = KeptRate(ENGINE_DECAY)  # every request's drafts: a new request's prior

    def rows(self, plan: SchedulerOutput) -> tuple[int, int]:
        """A plan's prompt rows and sampled rows (decodes and drafts), before its counters advance (nothing
        to count, and no step to fit, when drafting is off)."""
        if self.max_drafts <= 0:
            return 0, 0
        sampled = 0
        for req, n in zip(plan.requests, plan.num_tokens, strict=True):
            if n == 1 + req.num_draft_tokens and req.num_computed_tokens + n == req.num_tokens:
                sampled += n
        return plan.total_tokens - sampled, sampled

    def observe(self, prompt_rows: int, sampled_rows: int, seconds: float) -> None:
        if self.max_drafts > 0:
            self.cost.observe(prompt_rows, sampled_rows, seconds)

    def record(self, req: Request, proposed: int, kept: int) -> None:
        self.kept.add(proposed, kept)
        record(req, proposed, kept)

    def verify(
        self,
        req: Request,
        drawn: list[int],
        take: Callable[[int], RequestStatus | None],
        stats: Any,
        bm: BlockManager,
    ) -> RequestStatus | None:
        """A request's drafts against its draws: each draw is taken (``take``: returns its finished status)
        and the next is kept while the draft it checks equals the draw before it (the draw that follows a
        rejected draft is the request's correct next token). ``stats``: the engine's counters."""
        d = req.num_draft_tokens
        drafts = req.token_ids[-d:]
        del req.token_ids[-d:]
        req.num_computed_tokens -= d  # the drafts' K/V count again only where they are kept
        req.num_draft_tokens = 0
        stats.draft_tokens += d
        status = None
        kept = 0
        for tok in drawn:
            status = take(tok)
            if status is not None or kept == d or tok != drafts[kept]:
                break
            kept += 1
            req.num_computed_tokens += 1  # the draft's K/V, computed in this forward, is the token's
        stats.accepted_draft_tokens += kept
        if status is None:
            self.record(req, d, kept)
        bm.register_full_blocks(req)
        return status

    def schedule(self, scheduler: Scheduler, bm: BlockManager, max_model_len: int) -> SchedulerOutput:
        """The scheduler's plan, the running requests that can draft having proposed their next tokens
        first, each keeping the drafts the plan has room for."""
        drafted = self.draft(scheduler.running, scheduler.waiting, bm, max_model_len)
        plan = scheduler.schedule()
        if drafted:
            trim(drafted, plan)
        return plan

    def draft(
        self, running: list[Request], waiting: Sequence[Request], bm: BlockManager, max_model_len: int
    ) -> list[Request]:
        """Append drafts to the running requests whose drafts pay; returns those requests."""
        if self.max_drafts <= 0:
            return []
        rows = rows_without_drafts(running, waiting, self.budget, self.max_num_seqs)
        room = self.budget - rows  # more rows would push prompt tokens to a later step
        if room <= 0:
            return []
        decoding = sum(1 for r in running if r.num_computed_tokens == r.num_tokens - 1)
        threshold = self.cost.threshold(decoding, rows - decoding, decoding)
        # No request waits for a seat: the run ends with its longest request, and a draft kept by one of
        # the longest saves a whole step, not one token of it.
        tail = None if waiting else self.cost.threshold(1, rows - decoding, decoding)
        return draft(running, bm, self.max_drafts, max_model_len, room, threshold, self.kept.rate(), tail)


def rows_without_drafts(
    running: list[Request], waiting: Sequence[Request], budget: int, max_num_seqs: int
) -> int:
    """About the rows of the next step without drafts: the running requests' tokens, then the prompts of the
    waiting ones there are slots for, up to the token budget."""
    rows = sum(r.num_tokens - r.num_computed_tokens for r in running)
    slots = max_num_seqs - len(running)
    for req in waiting:
        if rows >= budget or slots <= 0:
            break
        rows += req.num_tokens - req.num_computed_tokens
        slots -= 1
    return min(rows, budget)


def draft(
    running: list[Request],
    bm: BlockManager,
    max_drafts: int,
    max_model_len: int,
    room: int | None = None,
    threshold: float = 0.0,
    prior: float = 0.5,
    tail: float | None = None,
) -> list[Request]:
    """Append drafts to the running requests that can take them, to each as many as pay at ``threshold``
    (one every ``PROBE_STEPS`` steps where none does), ``room`` in all; returns those requests. The pool
    keeps a block per running request spare: drafting must never be the reason a request is preempted.
    ``tail``: the threshold instead for the requests with at least half the longest one's tokens left."""
    spare = bm.num_free_blocks - len(running)
    room = max_drafts * len(running) if room is None else room

    def tokens_left(r: Request) -> int:
        return min(r.params.max_new_tokens - r.num_output_tokens, max_model_len - r.num_tokens)

    longest = max((tokens_left(r) for r in running), default=0) if tail is not None else 0
    drafted = []
    for req in running:
        if spare <= 0 or room <= 0:
            break
        left = tokens_left(req)
        k = min(max_drafts, left - 1, room)  # the token drawn after the drafts counts too
        if k <= 0 or not can_draft(req):
            continue
        if req.spec is None:
            req.spec = SpecState()
        spec = req.spec
        spec.idle += 1
        needed = tail if tail is not None and 2 * left >= longest else threshold
        k = window(spec.kept.rate(prior), needed, k)
        if k == 0 and spec.idle >= PROBE_STEPS:
            k = 1
        tokens = spec.ngrams.propose(req.token_ids, k) if k else []
        if not tokens:
            continue
        extra = bm.num_missing(req, req.num_tokens + len(tokens)) - bm.num_missing(req, req.num_tokens)
        if extra > spare:
            continue
        spare -= extra
        room -= len(tokens)
        spec.idle = 0
        req.token_ids.extend(tokens)
        req.num_draft_tokens = len(tokens)
        drafted.append(req)
    return drafted


def trim(drafted: list[Request], plan: SchedulerOutput) -> None:
    """Keep only the drafts the plan computes: none for a request it left out or preempted."""
    given = {id(r): n for r, n in zip(plan.requests, plan.num_tokens, strict=True)}
    for req in drafted:
        n = given.get(id(req))
        keep = 0 if n is None else min(req.num_draft_tokens, n - 1)
        if keep < req.num_draft_tokens:
            del req.token_ids[len(req.token_ids) - (req.num_draft_tokens - keep) :]
            req.num_draft_tokens = keep


def sampled_rows(sampling: list[Request]) -> tuple[list[Request], list[int]]:
    """The sampler's rows of a step and the output position each draws at: one per request, or d + 1 for a
    request verifying d drafts."""
    rows: list[Request] = []
    positions: list[int] = []
    for req in sampling:
        first = req.num_output_tokens - req.num_draft_tokens
        rows += [req] * (req.num_draft_tokens + 1)
        positions += range(first, first + req.num_draft_tokens + 1)
    return rows, positions


def per_request(tokens: list[int], sampling: list[Request]) -> list[list[int]]:
    """The tokens drawn at the rows of :func:`sampled_rows`, split by request."""
    drawn, i = [], 0
    for req in sampling:
        drawn.append(tokens[i : i + req.num_draft_tokens + 1])
        i += req.num_draft_tokens + 1
    return drawn
