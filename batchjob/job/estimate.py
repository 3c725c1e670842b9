"""``batchjob validate --estimate``: how long a job will take on this machine, and how many rows will fail,
before a long run.

1. Prompts: the job's first rows (all of them up to ``--estimate-rows``, else that many from the start of the
   stream) go through the job's own reader and prompt builder, streaming and timed, with a progress bar: a
   histogram of prompt lengths against the context, and the rows that will become errors (too long, no usable
   prompt). The first 1,000 rows are then written once as a part of the job's columns (in a folder of their
   own), timed: with the reading, a row's work outside the engine, a fifth to a third of a labeling job's
   time (3,000 rows of --choices or two output tokens on the tiny test model).
2. Calibration (``calibration.py``): the first usable prompts run through the engine with the job's settings
   (about 20 s: an untimed warm-up pass, then a timed one), fed as the job loop feeds it, timing every step
   against its number of tokens: a step costs about ``alpha + beta * tokens``. Short outputs go on with more
   rows until enough steps are timed to fit.
   The whole job then takes as many steps as its tokens (the sampled prompt lengths, and its outputs) fill at
   ``--max-num-batched-tokens``, or as its samples' seats in steps need at ``--max-num-seqs`` a step,
   whichever is more, plus the last batch's drain. A sample holds a seat for its output tokens and, as the
   calibration counted, for more steps: a ``choices`` row's scoring requests and its prompt's chunks (five
   steps a row of two output tokens). Outputs are counted per request: each row's samples (``n``, from the
   job or the row's own parameters, e.g. an OpenAI body) times its ``max_new_tokens``, times the share of
   that budget the calibration's samples used. A prompt is computed once for its samples; prompt tokens
   count at the rate the calibration computed them per prompt token of its rows (less with a shared
   system prompt in the prefix cache, more with ``choices`` scoring their labels). Drafts are not counted,
   so the figure errs on the slow side. The calibration runs at most
   ``--max-num-seqs`` samples of a row: it times steps, not a row's every sample.
3. The settings that matter changed (``--max-num-seqs``, ``--max-num-batched-tokens``, halved and
   doubled), as a small table: the same step costs in a different number of steps. (Timing each setting
   again took longer than the small jobs it estimated, and the fit tells the steps apart already.)

The line ``estimated time: <duration>`` (``41 s``, ``12.5 min``, ``3.2 h``, ``under 1 s`` for a job with rows
to run, or ``unknown`` when no sampled row is usable) is for scripts to read.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchjob.io.readers import iter_rows
from batchjob.job.calibration import Calibration, Prompt, warm_then_time
from batchjob.job.loop import part_writer, row_request, think_tags
from batchjob.job.manifest import Manifest
from batchjob.job.prepare import Prepared
from batchjob.job.progress import _duration as duration
from batchjob.job.rows.images import image_prompts, image_request
from batchjob.job.runner import load_engine, prompt_builder

__all__ = ["Calibration", "Estimate", "estimate"]

_FEED_ROWS = 4096  # prompts kept for the calibration to go on with past its first rows (short outputs)
_WRITE_ROWS = 1000  # rows written once, to time the writing of a row's result
_LENGTH_EDGES = [0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 10**9]


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
    row_seconds: float = 0.0  # a row's work outside the engine: read, prompt built, result written

    @property
    def ok(self) -> int:
        return len(self.lengths)

    def seconds(self, c: Calibration) -> float:
        """The whole job at ``c``'s cost per step: its usable rows (the sample's share of them, when
        extrapolated) with the sample's mean prompt length."""
        rows = self.total if self.total is not None else self.sampled
        engine = c.job_seconds(*self._job(rows))
        return engine + rows * self.row_seconds

    def steps(self, c: Calibration) -> float:
        """The engine steps of the whole job at ``c``'s settings."""
        return c.steps(*self._job(self.total if self.total is not None else self.sampled))

    def _job(self, rows: int) -> tuple[float, float, float]:
        """The whole job's output budget, prompt tokens and samples, from the rows looked at."""
        scale = rows / max(self.sampled, 1)
        return scale * self.budget_tokens, scale * sum(self.lengths), scale * self.samples

    def said(self, seconds: float) -> str:
        """A time as the estimate prints it: a job with rows to run never reads ``0 s``."""
        rows = self.total if self.total is not None else self.sampled
        return "under 1 s" if rows and seconds < 1 else duration(seconds)

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
            out.append(f"estimated time: {self.said(seconds)}")
        else:  # no sampled row is usable: nothing to time (the rows above say why)
            out.append(f"estimated time: unknown (no usable row among the {self.sampled:,} looked at)")
        out.append(
            f"  ({rows}; a step took {1000 * c.alpha:.1f} ms + {1000 * c.beta_prompt:.3f} ms a prompt token + "
            f"{1000 * c.beta_out:.3f} ms a decoded one, "
            f"{c.output_per_row:.1f} tokens out a sample, {c.computed_share:.2f} prompt tokens computed a prompt "
            f"token (prefix cache, choices), {c.extra_seat_steps:.1f} more steps a sample holds a seat (choices' "
            f"scoring, prompt chunks); {1000 * self.row_seconds:.2f} ms a row read, built and written; this "
            "machine, today's settings; plus model loading)"
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
                out.append(f"  {name:<34}  {self.said(self.seconds(alt))}")
        return out


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
    seen.read(prep, builder, max_rows, _FEED_ROWS, images)
    # each pass may end a step over its share, at most
    main = warm_then_time(engine, seen.prompts, 0.15 * seconds, 0.65 * seconds, calibration_rows)
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
        seen.read_seconds + _write_seconds(prep, engine, seen.values),
    )


def _write_seconds(prep: Prepared, engine: Any, values: list[dict[str, Any]]) -> float:
    """Seconds a row's result takes to write: rows looked at (their input columns, no results) written once as
    a part with the job's columns, into a folder of their own, and its digest taken, as a run commits one."""
    if not values:
        return 0.0
    writer = part_writer(prep, engine, think_tags(prep.spec, engine.tokenizer))
    with tempfile.TemporaryDirectory() as folder:
        writer.out_dir = Path(folder)
        start = time.perf_counter()
        writer.stamp(writer.write(0, [{"values": v} for v in values]))
        return (time.perf_counter() - start) / len(values)


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
    values: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the first rows' input columns
    read_seconds: float = 0.0  # a row's reading and prompt building, as the job's reader and builder did them

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
        start = time.perf_counter()  # the job's own reading and prompt building, timed: a run does the same
        for row in iter_rows(prep.sources, skip=skip, covered=covered):
            if self.sampled >= max_rows:
                break
            self.sampled += 1
            bar.update(1)
            if row.values is None:
                self.no_prompt += 1
                continue
            if len(self.values) < _WRITE_ROWS:
                self.values.append(row.values)
            pictures = None
            if images is None:
                params, ids, error = row_request(spec, builder, base, row)
            else:
                params, prompt, error = image_request(spec, images, base, row)
                ids, pictures = (None, None) if prompt is None else (prompt.ids, prompt.images)
            self._count(params, ids, error, calibration_rows, pictures)
        bar.close()
        self.read_seconds = (time.perf_counter() - start) / max(self.sampled, 1)
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
