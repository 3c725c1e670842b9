"""The estimate's calibration (``validate --estimate``): a short run of the job's first prompts through the
engine, fed as the job loop feeds it, every step timed against its tokens, and what a sample costs the engine
beyond its own output tokens (a ``choices`` row's scoring requests, a prompt's chunks). ``estimate.py`` turns
it into the whole job's time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

Prompt = tuple[list[int], Any, Any]  # a calibration prompt: its ids, sampling parameters, images (or None)

# Timed steps the calibration goes on feeding rows for (its first rows all go in however many steps they
# take): a job of short outputs finishes its first 64 rows in three steps, too few to fit a step's cost to
# (the fit then put 0.006 ms on a prompt token that cost 0.012 ms, and estimated 2 s for a 5 s job).
MIN_STEPS = 64


@dataclass
class Calibration:
    """A short run: its rate, and a fit of a step's time to its tokens (``alpha`` a step, and per prompt and
    per decoded token)."""

    settings: str
    rows: float  # finished samples, and the share of their output budget the unfinished ones got through
    seconds: float
    generated_tokens: int
    budget_tokens: int = 0  # the max_new_tokens of those samples (finished or cut short): what they could use
    alpha: float = 0.0  # seconds a step costs whatever its size
    beta_prompt: float = 0.0  # seconds per prompt token in a step
    beta_out: float = 0.0  # seconds per decoded token in a step
    max_num_seqs: int = 1
    budget: int = 1  # max_num_batched_tokens
    computed_share: float = 1.0  # prompt tokens computed per prompt token of the rows (prefix cache, choices)
    pool_tokens: int = 0  # the KV pool's tokens at most (0: not bounded here)
    # a sample's seats in steps beyond its output tokens (the step that samples one holds a seat): a
    # choices row's scoring requests, each a seat for a step, and a prompt's chunks that sample nothing
    extra_seat_steps: float = 0.0
    steps_timed: int = 0  # the steps the fit saw

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)

    @property
    def output_per_row(self) -> float:
        """Generated tokens a sample."""
        return self.generated_tokens / max(self.rows, 1e-9)

    @property
    def fill(self) -> float:
        """The share of their ``max_new_tokens`` the calibration's samples used (they stop early)."""
        return self.generated_tokens / self.budget_tokens if self.budget_tokens else 1.0

    def with_settings(self, settings: str, max_num_seqs: int | None, budget: int | None) -> Calibration:
        """The same step costs at another ``max_num_seqs`` or token budget: only the number of steps
        changes (a step's cost per token is taken to be the same)."""
        return dataclasses.replace(
            self,
            settings=settings,
            max_num_seqs=max_num_seqs or self.max_num_seqs,
            budget=budget or self.budget,
        )

    def seats(self, budget_tokens: float, prompt_tokens: float, samples: float) -> float:
        """Samples running at once: max_num_seqs, or fewer where the KV pool holds fewer samples of the
        job's mean length (prompt and output, each at its longest: the slow side)."""
        if not self.pool_tokens or samples <= 0:
            return self.max_num_seqs
        each = (prompt_tokens + budget_tokens * self.fill) / samples
        return max(1.0, min(self.max_num_seqs, self.pool_tokens / max(each, 1.0)))

    def steps(self, budget_tokens: float, prompt_tokens: float, samples: float = 0) -> float:
        """The engine steps of a job: as many as its tokens fill at the step budget, or as its samples' seats
        in steps (their output tokens, and the steps a seat holds beyond them) need at ``seats`` a step,
        whichever is more, and the last batch's drain."""
        seats = self.seats(budget_tokens, prompt_tokens, samples)
        generated = budget_tokens * self.fill
        tokens = prompt_tokens * self.computed_share + generated
        seat_steps = generated + samples * self.extra_seat_steps
        return max(tokens / self.budget, seat_steps / seats) + self.output_per_row

    def job_seconds(self, budget_tokens: float, prompt_tokens: float, samples: float = 0) -> float:
        """A job of ``prompt_tokens`` prompt tokens whose ``samples`` may generate ``budget_tokens`` in all,
        in steps of this calibration's cost (``steps``)."""
        if self.rows <= 0:
            return float("inf")
        steps = self.steps(budget_tokens, prompt_tokens, samples)
        computed = (
            prompt_tokens * self.computed_share
        )  # a shared prefix is computed once; choices score labels
        return steps * self.alpha + computed * self.beta_prompt + budget_tokens * self.fill * self.beta_out


def _fit(steps: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``seconds = alpha + beta_prompt * prompt_tokens + beta_out * other_tokens`` over
    steps (a prompt token and a decoded one cost differently); all three kept >= 0."""
    import numpy as np  # (numpy is loaded by then; only the estimate needs it here)

    if not steps:
        return 0.0, 0.0, 0.0
    a = np.array([[1.0, p, d] for p, d, _ in steps])
    y = np.array([t for _, _, t in steps])
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if not (coef < 0).any():
        return float(coef[0]), float(coef[1]), float(coef[2])
    # too few kinds of step to tell the three apart: a step's cost and one cost per token, else the latter
    tokens = a[:, 1] + a[:, 2]
    two = np.linalg.lstsq(np.stack([a[:, 0], tokens], axis=1), y, rcond=None)[0]
    if not (two < 0).any():
        return float(two[0]), float(two[1]), float(two[1])
    per = float(y.sum() / max(tokens.sum(), 1e-9))
    return 0.0, per, per


@dataclass
class _Run:
    """What a calibration pass counts as it steps."""

    rows: float = 0.0
    tokens: int = 0
    budget: int = 0
    done: set[str] = dataclasses.field(default_factory=set)  # the rows whose prompts were computed
    steps: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)  # (prompt, other, seconds)
    limits: dict[str, int] = dataclasses.field(default_factory=dict)  # each request's max_new_tokens
    lengths: dict[str, int] = dataclasses.field(default_factory=dict)  # each request's prompt length
    samples: dict[str, int] = dataclasses.field(default_factory=dict)  # each request's samples (n)
    fed: int = 0  # prompts given to the engine

    def feed(self, engine: Any, prompts: list[Prompt], first: int) -> None:
        """Give the engine prompts as the job loop does, at most twice ``max_num_seqs`` in it at once: the
        ``first`` all, then more while fewer than ``MIN_STEPS`` steps are timed (short outputs)."""
        cfg = engine.config
        window = max(8, 2 * cfg.max_num_seqs, first)
        while self.fed < len(prompts) and (self.fed < first or len(self.steps) < MIN_STEPS):
            if engine.num_unfinished >= window:
                return
            ids, params, images = prompts[self.fed]
            # a row's samples share its prompt: a few of them (at most a batch) time a step as well as all
            params = params.replace(n=min(params.n, cfg.max_num_seqs))
            extra = {} if images is None else {"images": images}  # (an engine without images takes none)
            name = f"calibrate-{self.fed}"
            engine.add_request(name, ids, params, **extra)
            self.limits[name], self.lengths[name], self.samples[name] = (
                params.max_new_tokens,
                len(ids),
                params.n,
            )
            self.fed += 1

    def step(self, engine: Any) -> None:
        stats = engine.stats
        batched, prompt, t0 = stats.batched_tokens, stats.computed_prompt_tokens, time.perf_counter()
        for out in engine.step():
            self.rows += 1
            self.done.add(out.request_id)
            self.tokens += len(out.token_ids)
            self.budget += self.limits[out.request_id]
        p = stats.computed_prompt_tokens - prompt
        self.steps.append((p, stats.batched_tokens - batched - p, time.perf_counter() - t0))

    def cut_short(self, engine: Any) -> tuple[int, int]:
        """The requests left when time ran out count by how far they got; they are aborted. Returns the
        prompt tokens reached (computed or from the cache) of the rows whose prompts were started, and
        their samples."""
        partial = {}  # cut short in its prompt: the prompt tokens it reached
        for req in engine.scheduler.running:
            if req.group_id in self.lengths and req.owner is None and req.num_output_tokens == 0:
                partial[req.group_id] = min(req.num_computed_tokens, req.num_prompt_tokens)
        for state in engine.snapshot():
            self.tokens += len(state.output_ids)
            self.rows += len(state.output_ids) / max(1, state.params.max_new_tokens)
            if state.output_ids:  # its prompt is done
                self.done.add(state.request_id)
            self.budget += len(state.output_ids)  # it has not stopped yet: it says nothing of stopping early
            engine.abort(state.request_id)
        reached = sum(self.lengths.get(rid, 0) for rid in self.done) + sum(
            n for rid, n in partial.items() if rid not in self.done
        )
        return reached, sum(self.samples.get(rid, 0) for rid in self.done | set(partial))


def calibrate(engine: Any, prompts: list[Prompt], seconds: float, first: int) -> Calibration:
    """Run ``prompts`` (ids, params, images) through ``engine`` until they finish or ``seconds`` pass, timing every
    step with its token count (the first, which warms caches up, is left out of the fit): the ``first`` of
    them, and more while fewer than ``MIN_STEPS`` steps are timed."""
    cfg = engine.config
    settings = f"max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens}"
    run = _Run()
    stats = engine.stats
    computed0, seats0 = stats.computed_prompt_tokens, stats.running_sum
    start = time.monotonic()
    run.feed(engine, prompts, first)
    while engine.has_unfinished() and time.monotonic() - start < seconds:
        run.step(engine)
        run.feed(engine, prompts, first)
    elapsed = time.monotonic() - start
    computed = stats.computed_prompt_tokens - computed0
    seat_steps = stats.running_sum - seats0  # each step's scheduled requests, helpers and chunks included
    reached, started = run.cut_short(engine)
    alpha, beta_prompt, beta_out = _fit(run.steps[1:] or run.steps)
    return Calibration(
        settings,
        run.rows,
        elapsed,
        run.tokens,
        run.budget,
        alpha,
        beta_prompt,
        beta_out,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        computed / reached if reached else 1.0,
        # per sample started: one cut short in its prompt held seats before its first token
        extra_seat_steps=max(0.0, seat_steps - run.tokens) / max(started, run.rows, 1),
        steps_timed=len(run.steps),
    )


def warm_then_time(engine: Any, prompts: list[Prompt], warm: float, timed: float, first: int) -> Calibration:
    """A first pass over a few prompts warms the kernels up (new batch shapes are slow the first time) and is
    not timed; the prefix cache is emptied after it, so the timed pass computes its prompts."""
    if prompts:
        calibrate(engine, prompts[:16], warm, 16)
        engine.reset_prefix_cache()
    return calibrate(engine, prompts, timed, first)
