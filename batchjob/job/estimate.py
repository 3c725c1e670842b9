"""``batchjob validate --estimate``: how long a job will take on this machine, and how many rows will fail,
before a long run.

1. Prompts: the job's first rows (all of them up to ``--estimate-rows``, else that many from the start of the
   stream) go through the job's own prompt builder, streaming, with a progress bar: a histogram of prompt
   lengths against the context, and the rows that will become errors (too long, no usable prompt).
2. Calibration: the first usable prompts run through the engine with the job's settings (about 20 s: an
   untimed warm-up pass, then a timed one), timing every step against its number of tokens: a step costs
   about ``alpha + beta * tokens``.
   The whole job then takes as many steps as its tokens (the sampled prompt lengths, and its outputs) fill at
   ``--max-num-batched-tokens``, or as its outputs need at ``--max-num-seqs`` samples a step, whichever is
   more, plus the last batch's drain. Outputs are counted per request: each row's samples (``n``, from the
   job or the row's own parameters, e.g. an OpenAI body) times its ``max_new_tokens``, times the share of
   that budget the calibration's samples used. A prompt is computed once for its samples; prompt tokens
   count at the rate the calibration computed them per prompt token of its rows (less with a shared
   system prompt in the prefix cache, more with ``choices`` scoring their labels). Drafts are not counted,
   so the figure errs on the slow side. The calibration runs at most
   ``--max-num-seqs`` samples of a row: it times steps, not a row's every sample.
3. The settings that matter changed (``--max-num-seqs``, ``--max-num-batched-tokens``, halved and
   doubled), as a small table: the same step costs in a different number of steps. (Timing each setting
   again took longer than the small jobs it estimated, and the fit tells the steps apart already.)

The line ``estimated time: <duration>`` (``41 s``, ``12.5 min``, ``3.2 h``, or ``unknown`` when no sampled row
is usable) is for scripts to read.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from batchjob.io.readers import iter_rows
from batchjob.job.loop import row_request
from batchjob.job.manifest import Manifest
from batchjob.job.prepare import Prepared
from batchjob.job.progress import _duration as duration
from batchjob.job.rows.images import image_prompts, image_request
from batchjob.job.runner import load_engine, prompt_builder

Prompt = tuple[list[int], Any, Any]  # a calibration prompt: its ids, sampling parameters, images (or None)

_LENGTH_EDGES = [0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 10**9]


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

    def job_seconds(self, budget_tokens: float, prompt_tokens: float, samples: float = 0) -> float:
        """A job of ``prompt_tokens`` prompt tokens whose ``samples`` may generate ``budget_tokens`` in all,
        in steps of this calibration's cost: as many steps as its tokens fill at the step budget, or as its
        outputs need at ``seats`` samples a step, whichever is more, and the last batch's drain."""
        if self.rows <= 0:
            return float("inf")
        seats = self.seats(budget_tokens, prompt_tokens, samples)
        generated = budget_tokens * self.fill
        prompt_tokens *= self.computed_share  # a shared prefix is computed once; choices score their labels
        tokens = prompt_tokens + generated
        steps = max(tokens / self.budget, generated / seats) + self.output_per_row
        return steps * self.alpha + prompt_tokens * self.beta_prompt + generated * self.beta_out


@dataclass
class Estimate:
    sampled: int  # rows looked at
    total: int | None  # rows of the job (this worker's share), when known
    lengths: list[int]  # prompt lengths of the usable sampled rows
    too_long: int
    no_prompt: int
    context: int
    samples: int  # of the usable sampled rows: their samples (n each)
    budget_tokens: int  # and the tokens those samples may generate (n * max_new_tokens each)
    calibration: Calibration
    alternatives: list[tuple[str, Calibration]]
    done: int = 0  # a resumed job's rows committed already: not in ``total``

    @property
    def ok(self) -> int:
        return len(self.lengths)

    def seconds(self, c: Calibration) -> float:
        """The whole job at ``c``'s cost per step: its usable rows (the sample's share of them, when
        extrapolated) with the sample's mean prompt length."""
        rows = self.total if self.total is not None else self.sampled
        scale = rows / max(self.sampled, 1)  # the whole job from the rows looked at
        return c.job_seconds(scale * self.budget_tokens, scale * sum(self.lengths), scale * self.samples)

    def lines(self) -> list[str]:
        out = [
            f"prompt lengths (tokens) of {self.ok:,} usable rows of the first {self.sampled:,}; context {self.context:,}:"
        ]
        counts = [0] * (len(_LENGTH_EDGES) - 1)
        for n in self.lengths:
            counts[next(i for i in range(len(counts)) if n < _LENGTH_EDGES[i + 1])] += 1
        top = max(counts) or 1
        for i, c in enumerate(counts):
            if c:
                lo, hi = _LENGTH_EDGES[i], _LENGTH_EDGES[i + 1] - 1
                over = " (beyond the context)" if lo >= self.context else ""
                out.append(f"  {lo:>6}-{hi:<6} {'#' * max(1, round(40 * c / top)):<40} {c:,}{over}")
        scale = (
            "" if self.total is None or self.total == self.sampled else f" (of {self.sampled:,} looked at)"
        )
        out.append(
            f"rows that will be errors: {self.too_long:,} too long for the context, {self.no_prompt:,} with no "
            f"usable prompt{scale}"
        )
        c = self.calibration
        out.append(
            f"calibration: {c.rows:.0f} samples in {c.seconds:.1f} s ({c.rows_per_s:.2f} samples/s, {c.tokens_per_s:.1f} "
            f"generated tok/s) with {c.settings}"
        )
        rows = f"{self.total:,} rows" if self.total is not None else f"the {self.sampled:,} rows looked at"
        if self.done:
            rows += f" left ({self.done:,} done already)"
        if self.samples != self.ok:  # --n, or requests' own n: the outputs to make
            per = self.samples / max(self.ok, 1)
            rows += f", {per:,.1f} samples a usable row ({self.samples:,} in the first {self.sampled:,})"
        seconds = self.seconds(c)
        if math.isfinite(seconds):
            out.append(f"estimated time: {duration(seconds)}")
        else:  # no sampled row is usable: nothing to time (the rows above say why)
            out.append(f"estimated time: unknown (no usable row among the {self.sampled:,} looked at)")
        out.append(
            f"  ({rows}; a step took {1000 * c.alpha:.1f} ms + {1000 * c.beta_prompt:.3f} ms a prompt token + "
            f"{1000 * c.beta_out:.3f} ms a decoded one, "
            f"{c.output_per_row:.1f} tokens out a sample, {c.computed_share:.2f} prompt tokens computed a prompt "
            "token (prefix cache, choices); this machine, today's settings; plus model loading)"
        )
        seats = c.seats(self.budget_tokens, sum(self.lengths), self.samples)
        if seats < c.max_num_seqs:  # then more seats change nothing: the pool bounds the batch
            out.append(
                f"  the KV pool holds about {seats:.0f} samples at once (of --max-num-seqs {c.max_num_seqs})"
            )
        if self.alternatives and c.alpha <= 0:
            # the settings change the number of steps, and only a step's own cost makes that matter
            out.append(
                "  other --max-num-seqs and --max-num-batched-tokens: not estimated (the calibration's steps "
                "were too alike to tell a step's own cost from its tokens' cost; more --estimate-rows may)"
            )
        elif self.alternatives:
            out.append(f"  {'with':<34}  estimated time")
            for name, alt in self.alternatives:
                out.append(f"  {name:<34}  {duration(self.seconds(alt))}")
        return out


def _fit(steps: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``seconds = alpha + beta_prompt * prompt_tokens + beta_out * other_tokens`` over
    steps (a prompt token and a decoded one cost differently); all three kept >= 0."""
    import numpy as np

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


def _calibrate(engine: Any, prompts: list[Prompt], seconds: float) -> Calibration:
    """Run ``prompts`` (ids, params, images) through ``engine`` until they finish or ``seconds`` pass, timing every
    step with its token count (the first, which warms caches up, is left out of the fit)."""
    cfg = engine.config
    settings = f"max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens}"
    limits = {}
    for i, (ids, params, images) in enumerate(prompts):
        # a row's samples share its prompt: a few of them (at most a batch) time a step as well as all
        params = params.replace(n=min(params.n, cfg.max_num_seqs))
        extra = {} if images is None else {"images": images}  # (an engine without images takes none)
        engine.add_request(f"calibrate-{i}", ids, params, **extra)
        limits[f"calibrate-{i}"] = params.max_new_tokens
    start = time.monotonic()
    rows: float = 0
    tokens = 0
    budget = 0
    steps: list[tuple[int, int, float]] = []  # (prompt tokens, other tokens, seconds) of each step
    stats = engine.stats
    computed0 = stats.computed_prompt_tokens
    lengths = {f"calibrate-{i}": len(ids) for i, (ids, _, _) in enumerate(prompts)}
    done: set[str] = set()  # the rows whose prompts were computed
    while engine.has_unfinished() and time.monotonic() - start < seconds:
        batched, prompt, t0 = stats.batched_tokens, stats.computed_prompt_tokens, time.perf_counter()
        for out in engine.step():
            rows += 1
            done.add(out.request_id)
            tokens += len(out.token_ids)
            budget += limits[out.request_id]
        p = stats.computed_prompt_tokens - prompt
        steps.append((p, stats.batched_tokens - batched - p, time.perf_counter() - t0))
    elapsed = time.monotonic() - start
    computed = stats.computed_prompt_tokens - computed0
    partial = {}  # cut short in its prompt: the prompt tokens it reached (computed or from the cache)
    for req in engine.scheduler.running:
        if req.group_id in lengths and req.owner is None and req.num_output_tokens == 0:
            partial[req.group_id] = min(req.num_computed_tokens, req.num_prompt_tokens)
    for state in engine.snapshot():  # cut short: the unfinished ones count by how far they got
        tokens += len(state.output_ids)
        rows += len(state.output_ids) / max(1, state.params.max_new_tokens)
        if state.output_ids:  # its prompt is done
            done.add(state.request_id)
        budget += len(state.output_ids)  # it has not stopped yet: it says nothing of stopping early
        engine.abort(state.request_id)
    reached = sum(lengths.get(rid, 0) for rid in done) + sum(
        n for rid, n in partial.items() if rid not in done
    )
    alpha, beta_prompt, beta_out = _fit(steps[1:] or steps)
    return Calibration(
        settings,
        rows,
        elapsed,
        tokens,
        budget,
        alpha,
        beta_prompt,
        beta_out,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        computed / reached if reached else 1.0,
    )


def _warm_then_time(engine: Any, prompts: list[Prompt], warm: float, timed: float) -> Calibration:
    """A first pass over a few prompts warms the kernels up (new batch shapes are slow the first time) and is
    not timed; the prefix cache is emptied after it, so the timed pass computes its prompts."""
    if prompts:
        _calibrate(engine, prompts[:16], warm)
        engine.reset_prefix_cache()
    return _calibrate(engine, prompts, timed)


def estimate(
    prep: Prepared,
    max_rows: int = 10_000,
    calibration_rows: int = 64,
    seconds: float = 20.0,
) -> Estimate:
    """Look at the job's first ``max_rows`` rows, calibrate on ``calibration_rows`` of them; ``seconds``: the
    calibration's budget (a warm-up pass, then the timed one; each may end a step after its share)."""
    spec = prep.spec
    engine = load_engine(spec)
    tokenizer = engine.tokenizer
    plan = prep.plan.for_tokenizer(spec, bool(getattr(tokenizer, "chat_template", None)))
    builder = prompt_builder(spec, plan, engine)
    images = image_prompts(spec, plan, engine, prep)  # image rows: the processor's ids, image tokens counted
    # a prefill-only task: no output; longer than the engine's limit fails
    prefill = spec.engine.task != "generate"
    context = engine.prefill_limit if prefill else engine.max_model_len
    seen = _Sample(prefill=prefill, context=context)
    seen.read(prep, builder, max_rows, calibration_rows, images)
    # each pass may end a step over its share, at most
    main = _warm_then_time(engine, seen.prompts, 0.15 * seconds, 0.65 * seconds)
    main.pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    alternatives = _alternatives(main, engine.config) if seen.prompts else []
    return Estimate(
        seen.sampled,
        seen.total,
        seen.lengths,
        seen.too_long,
        seen.no_prompt,
        context,
        seen.samples,
        seen.budget,
        main,
        alternatives,
        seen.done,
    )


@dataclass
class _Sample:
    """The rows looked at, as they are read: what becomes of each, and the first prompts to calibrate on."""

    prefill: bool  # a prefill-only task: no output; a prompt longer than ``context`` fails
    context: int
    sampled: int = 0
    total: int | None = None
    lengths: list[int] = dataclasses.field(default_factory=list)
    too_long: int = 0
    no_prompt: int = 0
    samples: int = 0
    budget: int = 0
    done: int = 0  # rows of a resumed job committed already (not looked at, not counted)
    prompts: list[Prompt] = dataclasses.field(default_factory=list)

    def read(
        self, prep: Prepared, builder: Any, max_rows: int, calibration_rows: int, images: Any = None
    ) -> None:
        """The first ``max_rows`` rows of this worker's share through the job's own prompt builder."""
        spec = prep.spec
        base = spec.sampling_params(prep.info.job_seed)
        # a resumed job: only the rows a run would do (those committed are skipped, as the loop skips them)
        manifest = Manifest(prep.state.manifest_file, readonly=True) if prep.resumed else None
        skip, covered = prep.shard.filters(manifest.done if manifest is not None else _nothing())
        total = prep.shard.share_of(prep.info.row_counts)
        self.done = manifest.rows if manifest is not None else 0
        self.total = total = None if total is None else max(0, total - self.done)
        bar = tqdm(
            total=min(max_rows, total) if total is not None else max_rows,
            unit="row",
            desc="prompts",
            disable=None,
        )
        for row in iter_rows(prep.sources, skip=skip, covered=covered):
            if self.sampled >= max_rows:
                break
            self.sampled += 1
            bar.update(1)
            if row.values is None:
                self.no_prompt += 1
                continue
            pictures = None
            if images is None:
                params, ids, error = row_request(spec, builder, base, row)
            else:
                params, prompt, error = image_request(spec, images, base, row)
                ids, pictures = (None, None) if prompt is None else (prompt.ids, prompt.images)
            self._count(params, ids, error, calibration_rows, pictures)
        bar.close()
        if total is None and self.sampled < max_rows:
            self.total = self.sampled  # the whole stream was read

    def _count(
        self, params: Any, ids: list[int] | None, error: str | None, calibration_rows: int, images: Any = None
    ) -> None:
        if ids is None or params is None:
            if error and "does not fit the context" in error:
                self.too_long += 1
            else:
                self.no_prompt += 1
            return
        if self.prefill and len(ids) > self.context:  # --truncate cut it already (prompt_builder)
            self.too_long += 1
            return
        self.lengths.append(len(ids))
        self.samples += params.n
        self.budget += 0 if self.prefill else params.n * params.max_new_tokens
        if len(self.prompts) < calibration_rows:
            self.prompts.append((ids, params, images))


def _alternatives(main: Calibration, cfg: Any) -> list[tuple[str, Calibration]]:
    """The settings that matter, halved and doubled, at ``main``'s cost per step."""
    alternatives = []
    for name, seqs, tokens in (  # not the rows' output budget: the engine's token budget per step
        (f"--max-num-seqs {max(1, cfg.max_num_seqs // 2)}", max(1, cfg.max_num_seqs // 2), None),
        (f"--max-num-seqs {cfg.max_num_seqs * 2}", cfg.max_num_seqs * 2, None),
        (
            f"--max-num-batched-tokens {max(16, cfg.max_num_batched_tokens // 2)}",
            None,
            max(16, cfg.max_num_batched_tokens // 2),
        ),
        (
            f"--max-num-batched-tokens {cfg.max_num_batched_tokens * 2}",
            None,
            cfg.max_num_batched_tokens * 2,
        ),
    ):
        alternatives.append((name, main.with_settings(name, seqs, tokens)))
    return alternatives


def _nothing() -> Any:
    from batchjob.job.intervals import IntervalSet

    return IntervalSet()
