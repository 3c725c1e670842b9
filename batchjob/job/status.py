"""A job's progress read from its output folder alone, all workers added up; reads, never writes.

Every worker's share is described by its own manifest (rows, errors, tokens), ``progress.json`` (complete?)
and ``stats.json`` (throughput of its last run); whether it is running now is whether its lock is held
(the lock file names the process holding it). A running worker's ``stats.json`` also says, every few
seconds, how many rows it has finished but not yet committed, is generating, and has read ahead.
The manifest is not taken on trust: each part it lists is checked (``verify.py``: exists, recorded size,
footer row count), and the rows of a missing or damaged part are not counted as done; a worker marked
complete with such a part is "incomplete" until ``batchjob run`` redoes them. The inputs are checked against
the job's records too, so a job whose inputs changed is never reported complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.errors import InputError, StateError
from batchjob.io.atomic import CorruptStateError, read_json
from batchjob.job.adapter_counts import AdapterCounts, adapter_counts, adapter_label
from batchjob.job.inputs import changes_now, only_growth
from batchjob.job.manifest import Manifest
from batchjob.job.owned import foreign_entries
from batchjob.job.shard import Shard
from batchjob.job.state import StateDir
from batchjob.job.verify import PartProblem, check_parts


@dataclass
class WorkerStatus:
    shard: Shard
    # "complete" | "running" | "stopped" | "not started" | "incomplete" (complete but for damaged parts, or
    # rows its manifest no longer lists)
    state: str
    rows_done: int = 0  # input rows
    rows_total: int | None = None  # this worker's share
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    parts: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # of its last (or current) run
    stats_file: Path | None = None
    problems: list[PartProblem] = field(default_factory=list)  # missing or damaged parts (rows not counted)
    stats_problem: str | None = None  # why its stats.json could not be read (stats are then unavailable)
    samples: int = 0  # result rows of the rows done (--n N: N a row)
    holder: dict[str, Any] = field(default_factory=dict)  # a running worker: its pid, host, since (lock file)
    unlisted: int = 0  # rows of a worker marked complete that its manifest does not list (lines lost)

    @property
    def live(self) -> dict[str, Any]:
        """A running worker's in-flight counts as it last wrote them (stats.json), else {}; {} too while they
        are an earlier run's (written before the running one took the lock): it has written none yet."""
        live = self.stats.get("live") if self.state == "running" else None
        if not isinstance(live, dict):
            return {}
        since = self.holder.get("since")
        if isinstance(since, (int, float)) and float(live.get("updated", 0)) < since:
            return {}
        return live

    def uncommitted(self, live: dict[str, Any]) -> int:
        """The rows ``live`` counted as finished and not committed, less those its manifest took since: a run
        writes its figures, then commits every row it has finished (a checkpoint's, and a full part's between
        them), so until it writes them again the rows are counted committed and in flight both."""
        finished = int(live.get("finished_uncommitted", 0))
        then = live.get("committed_rows", (self.stats.get("job") or {}).get("rows_done"))  # older: job's
        if not isinstance(then, int):
            return finished
        listed = self.rows_done + self.rows_to_redo  # its manifest's rows now, its damaged parts' too
        return max(0, finished - max(0, listed - then))

    @property
    def rows_to_redo(self) -> int:
        return sum(p.record.rows for p in self.problems)


@dataclass
class JobStatus:
    out_dir: Path
    workers: list[WorkerStatus]
    rows_total: int | None  # all rows of the job's input, once known
    input_changes: list[str] = field(default_factory=list)  # the inputs now differ from what the job read
    task: str = "generate"  # the job's --task (a prefill-only task reads tokens, generates none)
    # a LoRA job's committed rows by adapter (adapter_counts.BASE: the base model), in the job's order
    adapters: dict[str, AdapterCounts] = field(default_factory=dict)
    foreign: list[str] = field(default_factory=list)  # what readers of the folder read beside the job's parts

    @property
    def complete(self) -> bool:
        return not self.input_changes and all(w.state == "complete" for w in self.workers)

    @property
    def problems(self) -> list[PartProblem]:
        return [p for w in self.workers for p in w.problems]

    def total(self, key: str) -> int:
        return sum(getattr(w, key) for w in self.workers)

    @property
    def last_runs(self) -> list[WorkerStatus]:
        """The workers whose runs' figures are the job's throughput: the running ones while any runs, else
        all (their last runs)."""
        return [w for w in self.workers if w.state == "running"] or self.workers

    def rate(self, key: str) -> float:
        """A throughput summed over the workers' last runs (over the running ones while any runs)."""
        return sum(float(w.stats.get(key, 0) or 0) for w in self.last_runs)

    def next_step(self) -> str:
        """What to do before exporting a job that is not complete: wait for a running one; run it again, with
        --append where its inputs only grew (a plain rerun is refused then); inputs changed otherwise are
        refused even so, and the message says that instead."""
        if any(w.state == "running" for w in self.workers):
            return "it is running now: export again once it completes"
        if not self.input_changes:
            return "run it again with the same command, then export"
        if only_growth(self.input_changes):
            return (
                "run it again with --append to take in its inputs' new rows (`batchjob status` lists them), "
                "then export"
            )
        return (
            "its inputs changed since it ran (`batchjob status` says how) and `batchjob run` refuses them: "
            "restore the inputs it started with, run it again, then export"
        )

    # -- the report `batchjob status` prints ---------------------------------------------------------------

    def lines(self, shown_as: str) -> list[str]:
        """The report, a line each: the state, what changed or is damaged, the counts, then the worker (one)
        or the workers' totals and a line per worker. ``shown_as`` names the folder as the user typed it."""
        lines = [self._state_line(shown_as), *self._trouble_lines()]
        lines += self._count_lines() + self._adapter_lines()
        if len(self.workers) == 1:
            return lines + self._worker_lines(self.workers[0])
        return lines + self._workers_lines()

    def _state_line(self, shown_as: str) -> str:
        finished = sum(w.state == "complete" for w in self.workers)
        workers = f" ({finished} of {len(self.workers)} workers complete)" if len(self.workers) > 1 else ""
        running = [w for w in self.workers if w.state == "running"]
        state = "complete" if self.complete else "incomplete"
        if running:  # a run is active: what is committed is not all it has done
            who = [
                f"pid {w.holder['pid']} on {w.holder.get('host', '?')}"
                for w in running
                if w.holder.get("pid")
            ]
            state += f", running now ({', '.join(who) or f'{len(running)} workers'})"
        if self.foreign:  # the job's own rows may be all there, but the folder reads as more
            names = ", ".join(str(Path(shown_as) / name) for name in self.foreign)
            state += (
                f", but {names} {'is' if len(self.foreign) == 1 else 'are'} not the job's: readers of the folder "
                "will read it too (move it out of the output folder)"
            )
        return f"{shown_as}: {state}{workers}"

    def _trouble_lines(self) -> list[str]:
        """Changed inputs, unreadable stats, and missing or damaged parts (whose rows are not done)."""
        lines = []
        if self.input_changes:
            lines.append(
                "inputs changed since the job ran (`batchjob run` refuses them, or --append takes in growth):"
            )
            lines += [f"  {line}" for line in self.input_changes]
        lines += [f"stats: {w.stats_problem}" for w in self.workers if w.stats_problem]
        lines += [line for w in self.workers if (line := _died_line(w, len(self.workers) > 1))]
        lines += [f"missing or damaged: {p} ({p.record.rows} rows)" for p in self.problems]
        for w in self.workers:
            if w.unlisted and w.rows_total is not None:
                who = w.shard.name if len(self.workers) > 1 else "the job"
                lines.append(
                    f"{who}: its manifest lists {w.rows_total - w.unlisted} of {w.rows_total} rows "
                    f"({w.unlisted} lost from it): `batchjob run` redoes them"
                )
        if self.problems:
            redo = self.total("rows_to_redo")
            lines.append(
                f"{redo} rows not done ({len(self.problems)} parts missing or damaged): "
                "`batchjob run` with the same command redoes them"
            )
        return lines

    def _count_lines(self) -> list[str]:
        """Rows done (and in flight), samples, errors and tokens, over every worker."""
        done, total = self.total("rows_done"), self.rows_total
        tenths = 1000 * done // total if total else 0  # floored: 1999 of 2000 is 99.9%, never 100.0%
        pct = f" ({tenths // 10}.{tenths % 10}%)" if total else ""
        lines = [f"rows: {done} of {total if total is not None else 'unknown'} input rows{pct}"]
        live = [w.live for w in self.workers if w.state == "running" and w.live]
        if live:
            age = max(0.0, time.time() - min(float(x.get("updated", 0)) for x in live))
            finished = sum(w.uncommitted(w.live) for w in self.workers if w.state == "running" and w.live)
            seqs = [w.stats.get("batch_occupancy", {}).get("max_num_seqs") for w in self.workers if w.live]
            at_once = f" (up to {sum(seqs)} at a time, the rest queued)" if all(seqs) else ""
            lines.append(
                f"in flight: {finished} more rows finished, not yet committed; "
                f"{sum(int(x.get('in_engine', 0)) for x in live)} in the engine{at_once}, "
                f"{sum(int(x.get('read_ahead', 0)) for x in live)} read ahead (as of {age:.0f} s ago; the "
                "rows above are committed)"
            )
        lines += [line for line in [self.samples_line()] if line]
        lines.append(f"errors: {self.total('errors')} rows")
        return [*lines, self.tokens_line()]

    def samples_line(self) -> str | None:
        """--n: the result rows of the committed rows, where an input row has several; else None."""
        samples, done = self.total("samples"), self.total("rows_done")
        if samples == done:
            return None
        return f"samples: {samples} result rows ({samples / max(done, 1):g} a row)"

    def tokens_line(self) -> str:
        """The committed rows' tokens: in and out, or a prefill-only task's tokens read (none generated)."""
        if self.task != "generate":
            return f"tokens: {self.total('prompt_tokens')} read (--task {self.task})"
        return f"tokens: {self.total('prompt_tokens')} in, {self.total('generated_tokens')} out"

    def throughput(self, stats: dict[str, Any] | None = None) -> str:
        """The rates of one run (``stats``: a worker's stats.json), or of the workers' last runs summed:
        generated tokens/s, or a prefill-only task's rows/s and tokens read/s (it generates none)."""

        def rate(key: str) -> float:
            return self.rate(key) if stats is None else float(stats.get(key, 0) or 0)

        if self.task != "generate":
            return f"{rate('rows_per_s'):.1f} rows/s, {rate('total_tokens_per_s'):.1f} tok/s read"
        return f"{rate('generated_tokens_per_s'):.1f} generated tok/s"

    def _adapter_lines(self) -> list[str]:
        """A LoRA job: each adapter's committed rows, errors and generated tokens (a prefill-only task's: the
        tokens it read)."""
        if not self.adapters:
            return []
        width = max(len(adapter_label(name)) for name in self.adapters)
        generate = self.task == "generate"
        return ["adapters:"] + [
            f"  {adapter_label(name):<{width}}  {c.rows} rows, {c.errors} errors, "
            + (f"{c.generated_tokens} tokens out" if generate else f"{c.prompt_tokens} tokens read")
            for name, c in self.adapters.items()
        ]

    def _worker_lines(self, w: WorkerStatus) -> list[str]:
        """A job of one worker: its last run's throughput, and where its parts and stats are."""
        lines = []
        if w.stats and self.task != "generate":
            lines.append(
                f"last run: {w.stats.get('rows', 0)} rows in {w.stats.get('elapsed_s', 0):.1f} s, "
                + self.throughput(w.stats)
            )
        elif w.stats:
            run_samples = w.stats.get("samples", w.stats.get("rows", 0))
            extra = f" ({run_samples} samples)" if run_samples != w.stats.get("rows", 0) else ""
            lines.append(
                f"last run: {w.stats.get('rows', 0)} rows{extra} in {w.stats.get('elapsed_s', 0):.1f} s, "
                f"{self.throughput(w.stats)}, "
                + (
                    f"{w.stats['images']} images, {w.stats['images_per_s']:.2f}/s, "
                    if "images" in w.stats
                    else ""
                )
                + f"{w.stats.get('preemptions', 0)} preemptions"
            )
        return [*lines, f"parts: {w.parts}; stats: {w.stats_file}"]

    def _workers_lines(self) -> list[str]:
        """A job of several workers: the summed throughput, the parts, and a line per worker."""
        runs = "current" if any(w.state == "running" for w in self.workers) else "last"
        # rows/s too (a prefill-only task's throughput has them already)
        rows = f", {self.rate('rows_per_s'):.2f} rows/s" if self.task == "generate" else ""
        lines = [
            f"throughput: {self.throughput()}{rows} (workers' {runs} runs, summed)",
            f"parts: {self.total('parts')}",
        ]
        for w in self.workers:
            line = f"  {w.shard}: {w.state}"
            if w.state != "not started":
                share = w.rows_total if w.rows_total is not None else "unknown"
                line += f", {w.rows_done} of {share} rows, {w.errors} errors"
                if w.stats:
                    line += f", {self.throughput(w.stats)}"
            lines.append(line)
        return lines


def _died_line(w: WorkerStatus, named: bool) -> str | None:
    """A worker not running whose last run's stats say it still held finished rows it had not committed: it
    was killed (or crashed) before it could save them; the next run redoes them. ``named``: say which worker."""
    live = w.stats.get("live") if w.state in ("stopped", "not started") else None
    if not isinstance(live, dict) or not (lost := w.uncommitted(live)):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(live.get("updated", 0))))
    who = f"{w.shard}: " if named else ""
    return (
        f"{who}the last run ended without committing {lost} rows it had finished (killed or crashed; its "
        f"last progress was saved at {when}), so the 'last run' figures count rows not done: `batchjob "
        "run` with the same command redoes them"
    )


def read_stats(path: Path) -> tuple[dict[str, Any], str | None]:
    """A worker's ``stats.json`` and, when it can't be trusted, why not.

    Statistics are derived data (throughput and timings of a run; the job's counts come from the manifest)
    and every run writes them anew, so a torn or altered file costs only the statistics: they are
    unavailable until the next run, never the job (``run`` does not read them either).
    """
    if not path.exists():
        return {}, None
    try:
        stats = read_json(path)
    except StateError as e:
        what = f"{path} {e.reason}" if isinstance(e, CorruptStateError) else str(e)
        return {}, f"{what}: run statistics are unavailable until the next `batchjob run` writes them"
    if not isinstance(stats, dict):
        return {}, f"{path} is not a stats file: run statistics are unavailable until the next `batchjob run`"
    return stats, None


def job_status(out_dir: Path) -> JobStatus:
    root = StateDir(out_dir)
    if not root.exists():
        raise InputError(f"{out_dir} holds no batchjob job (no {root.job_file})")
    info = root.load_job()
    count = int((info.fingerprint.get("sharding") or {}).get("num_shards", 1))
    chunk_rows = info.chunk_rows or 1
    workers = []
    parts: list[str] = []  # the committed parts status vouches for, every worker's
    for i in range(count):
        shard = Shard(i, count, "the saved job", chunk_rows)
        state = StateDir(out_dir, shard)
        if not state.work.is_dir():
            workers.append(WorkerStatus(shard, "not started"))
            continue
        mine = state.load_job()
        manifest = Manifest(state.manifest_file, readonly=True)
        stats, stats_problem = read_stats(state.stats_file)
        for r in mine.inputs:  # row counts a worker learned by reading to the end
            known = next(x for x in info.inputs if x.seq == r.seq)
            known.rows = known.rows if known.rows is not None else r.rows
        problems = check_parts(out_dir, manifest)
        if mine.complete:
            run_state = "incomplete" if problems else "complete"
        else:
            run_state = "running" if state.locked_by_other() else "stopped"
        holder = state.lock_holder() if run_state == "running" else {}
        lost = [p.record for p in problems]
        parts += [r.name for r in manifest.parts if r not in lost]
        workers.append(
            WorkerStatus(
                shard,
                run_state,
                manifest.rows - sum(r.rows for r in lost),
                None,
                manifest.errors - sum(r.errors for r in lost),
                manifest.prompt_tokens - sum(r.prompt_tokens for r in lost),
                manifest.generated_tokens - sum(r.generated_tokens for r in lost),
                len(manifest.parts) - len(lost),
                stats,
                state.stats_file,
                problems,
                stats_problem=stats_problem,
                samples=sum(r.result_rows or r.rows for r in manifest.parts if r not in lost),
                holder=holder,
            )
        )
    for w in workers:
        w.rows_total = w.shard.share_of(info.row_counts)
        listed = w.rows_done + w.rows_to_redo  # the rows its manifest lists, damaged parts' too
        if w.state == "complete" and w.rows_total is not None and listed < w.rows_total:
            w.state, w.unlisted = "incomplete", w.rows_total - listed  # its manifest lost lines
    task = str((info.fingerprint.get("task") or {}).get("task", "generate"))
    changes = changes_now(info.inputs, info.input_paths, out_dir)
    lora = info.fingerprint.get("lora") or {}  # the job's adapters by name (none: not a LoRA job)
    adapters = adapter_counts(out_dir, parts, lora) if lora else {}
    return JobStatus(out_dir, workers, info.total_rows, changes, task, adapters, foreign_entries(out_dir))
