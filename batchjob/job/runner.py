"""The job loop: read rows, build prompts, keep the engine fed, write finished rows, checkpoint, resume.

Rows are keyed two ways: the id (``--id-column``, else ``"<file>:<row>"``) that the engine and the seeded
sampler see, and the ordinal (the row's position in the input stream) that says what is done. Finished rows
are buffered and committed as Parquet parts; every checkpoint commits the buffer and then saves the engine's
unfinished requests. Whatever moment the process dies at, a resume skips committed ordinals, continues the
checkpointed requests from their saved tokens, and recomputes everything else: because a request's tokens are
a pure function of (prompt, seed, id, position), the result equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchjob import faults, signals
from batchjob.errors import BatchjobError, InputError
from batchjob.io.atomic import write_json
from batchjob.io.readers import Row, input_schema, iter_rows
from batchjob.io.sources import Source, count_rows, discover
from batchjob.io.writers import EXTRA_FIELDS, PartWriter
from batchjob.job.intervals import IntervalSet
from batchjob.job.manifest import Manifest, PartRecord
from batchjob.job.prompts import PromptBuilder, PromptPlan, plan_prompts, resolve_chat
from batchjob.job.shard import Shard, choose_chunk_rows
from batchjob.job.spec import JobSpec
from batchjob.job.state import STATE_DIR, JobInfo, JobMismatchError, StateDir, fingerprint_changes
from batchjob.job.stats import RunStats

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT with its state saved; run again to resume
_PART_ROWS = 5000  # commit a part at least this often, checkpoint or not


class TooManyErrors(BatchjobError):
    """``--max-errors`` rows have failed; the state is saved and the job stops."""

    exit_code = 1


@dataclass
class JobResult:
    status: str  # "complete" | "already complete" | "interrupted"
    out_dir: Path
    rows_done: int
    rows_total: int | None
    errors: int
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.status == "interrupted" else 0


@dataclass
class Prepared:
    """Everything checked before any work: inputs, schema, prompt plan, identity, saved state."""

    spec: JobSpec
    out_dir: Path
    state: StateDir
    sources: list[Source]
    info: JobInfo  # saved (resume) or new
    resumed: bool
    plan: PromptPlan
    shard: Shard = field(default_factory=Shard)  # this worker's share, chunk_rows as saved with the job


def model_identity(model: str | None) -> str:
    from batchjob.models import DEFAULT_MODEL, resolve_model

    if model in (None, "", "default"):
        return DEFAULT_MODEL
    resolved = resolve_model(model)
    path = Path(resolved)
    return str(path.resolve()) if path.exists() else resolved


def _check_output(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--output {out_dir} is a file, not a folder")
    existing = next((p for p in [out_dir, *out_dir.absolute().parents] if p.exists()), None)
    if existing is not None and existing != out_dir and not os.access(existing, os.W_OK):
        raise InputError(f"--output {out_dir} cannot be created: {existing} is not writable")
    if out_dir.is_dir() and not (out_dir / STATE_DIR).exists():
        visible = [e for e in out_dir.iterdir() if not e.name.startswith((".", "_"))]
        if visible:
            raise InputError(
                f"--output {out_dir} already holds other files (e.g. {visible[0].name}) and no batchjob job; "
                "give a new or empty folder"
            )


def prepare(spec: JobSpec, has_chat_template: bool = True, shard: Shard | None = None) -> Prepared:
    """Check the job against its inputs and saved state, without loading the model.

    ``shard``: this worker's share of a job split over several workers (default: the whole job).
    """
    spec.require_io()
    shard = shard or Shard()
    out_dir = Path(spec.output)  # type: ignore[arg-type]
    _check_output(out_dir)
    sources = discover(spec.input, exclude=out_dir)
    state = StateDir(out_dir, shard)
    saved = state.load_job() if state.exists() else None
    schema = saved.schema if saved else input_schema(sources[0])
    plan = plan_prompts(spec, schema.names, has_chat_template)
    fingerprint = {
        "model": {"model": model_identity(spec.model), "dtype": spec.dtype},
        "inputs": [s.name for s in sources],
        "prompt": spec.prompt_fingerprint() | {"resolved_column": plan.column},
        "sampling": spec.sampling_fingerprint(),
        "sharding": {"num_shards": shard.count},
    }
    if saved is not None:
        changes = fingerprint_changes({"sharding": {"num_shards": 1}} | saved.fingerprint, fingerprint)
        if changes:
            raise JobMismatchError(
                f"--output {out_dir} holds a different job; changed: {'; '.join(changes)}. "
                "Use the original options to resume, or a new --output folder"
            )
        shard = replace(shard, chunk_rows=saved.chunk_rows or shard.chunk_rows)
        return Prepared(spec, out_dir, state, sources, saved, True, plan, shard)
    info = JobInfo(fingerprint, random.getrandbits(62), schema)
    if not shard.single:
        counts = [count_rows(s) for s in sources]
        info.chunk_rows = choose_chunk_rows(None if None in counts else sum(counts), shard.count)  # type: ignore[arg-type]
        shard = replace(shard, chunk_rows=info.chunk_rows)
    return Prepared(spec, out_dir, state, sources, info, False, plan, shard)


@dataclass
class _Pending:
    row: Row
    row_id: str
    num_prompt_tokens: int
    first_run: float | None = None
    samples: dict[int, Any] = field(default_factory=dict)  # --n: finished samples, written together


class _Loop:
    """One process's run of a job."""

    def __init__(self, prep: Prepared, engine: Any, builder: PromptBuilder) -> None:
        self.prep = prep
        self.spec = prep.spec
        self.engine = engine
        self.builder = builder
        self.state = prep.state
        self.manifest = Manifest(self.state.manifest_file)
        self.params = self.spec.sampling_params(prep.info.job_seed)
        self.writer = PartWriter(
            prep.out_dir, prep.info.schema, part_prefix(prep.shard), extra_fields(self.params)
        )
        self.max_num_seqs = int(engine.config.max_num_seqs)
        self.window = max(8, 2 * self.max_num_seqs)
        self.pending: dict[str, _Pending] = {}  # rows prepared or in the engine, by id
        self.ready: deque[tuple[str, list[int], list[int] | None]] = (
            deque()
        )  # prepared, not yet in the engine
        self.buffer: list[dict[str, Any]] = []
        self.buffer_ordinals = IntervalSet()
        self.stats = RunStats(self.max_num_seqs)
        self.stop_signal: int | None = None

    # -- committing -----------------------------------------------------------------------------------

    def _finish_row(
        self,
        row: Row,
        text: str | None,
        reason: str,
        n_prompt: int,
        n_gen: int,
        error: str | None,
        samples: list[dict[str, Any]] | None = None,
    ) -> None:
        """Buffer a row's result; ``samples``: the feature columns of each of its result rows (--n gives
        several, all buffered at once so they land in one part)."""
        base = {
            "ordinal": row.ordinal,
            "values": row.values,
            "generated_text": text,
            "finish_reason": reason,
            "num_prompt_tokens": n_prompt,
            "num_generated_tokens": n_gen,
            "error": error,
        }
        for extra in samples or [{"sample_index": 0}]:
            self.buffer.append(base | extra)
        self.buffer_ordinals.add(row.ordinal)
        self.stats.row(n_prompt, n_gen, error is not None)
        self.bar.update(1)

    def commit(self) -> None:
        if not self.buffer:
            return
        rows = sorted(self.buffer, key=lambda r: (r["ordinal"], r.get("sample_index", 0)))
        name = self.writer.write(len(self.manifest.parts), rows)
        self.manifest.append(
            PartRecord(
                name=name,
                rows=len({r["ordinal"] for r in rows}),  # input rows (--n writes several result rows each)
                errors=sum(r["error"] is not None for r in rows),
                prompt_tokens=sum(r["num_prompt_tokens"] or 0 for r in rows),
                generated_tokens=sum(r["num_generated_tokens"] or 0 for r in rows),
                ordinals=self.buffer_ordinals.ranges(),
            )
        )
        self.buffer = []
        self.buffer_ordinals = IntervalSet()

    def checkpoint(self) -> None:
        """Commit finished rows, then save the unfinished requests; both atomic, in this order."""
        self.commit()
        requests = []
        by_id: dict[str, dict[str, Any]] = {}
        for snap in self.engine.snapshot():
            p = self.pending[snap.request_id]
            record = {"ordinal": p.row.ordinal, "id": snap.request_id, "prompt_ids": list(snap.prompt_ids)}
            if self.params.n == 1:
                requests.append(record | {"output_ids": list(snap.output_ids)})
                continue
            # --n: one record per row, the unfinished samples' tokens by sample index (finished ones
            # that wait for their siblings are recomputed on resume: same tokens, they are seeded).
            record = by_id.setdefault(snap.request_id, record | {"samples": {}})
            record["samples"][str(snap.sample_index)] = list(snap.output_ids)
        requests += by_id.values()
        for row_id, ids, output_ids in self.ready:  # restored from the last checkpoint, not yet re-added
            if output_ids:
                ordinal = self.pending[row_id].row.ordinal
                record = {"ordinal": ordinal, "id": row_id, "prompt_ids": ids}
                if isinstance(output_ids, dict):
                    requests.append(record | {"samples": {str(k): v for k, v in output_ids.items()}})
                else:
                    requests.append(record | {"output_ids": output_ids})
        self.state.save_inflight(requests)
        self.write_stats()

    def write_stats(self) -> None:
        body = self.stats.to_json(
            self.engine.stats.as_dict() if hasattr(self.engine.stats, "as_dict") else {}
        )
        stream_total = self.prep.info.total_rows or self.stream_hint
        body["job"] = {
            "rows_done": self.manifest.rows,
            "rows_total": self.prep.shard.share(stream_total),  # this worker's share
            "job_rows_total": stream_total,  # all workers'
            "shard_index": self.prep.shard.index,
            "num_shards": self.prep.shard.count,
            "errors": self.manifest.errors,
            "prompt_tokens": self.manifest.prompt_tokens,
            "generated_tokens": self.manifest.generated_tokens,
            "complete": self.prep.info.complete,
        }
        write_json(self.state.stats_file, body)

    # -- feeding the engine ---------------------------------------------------------------------------

    def _admit(self, row: Row, inflight: dict[int, dict[str, Any]]) -> None:
        if row.error is not None or row.values is None:
            self._finish_row(row, None, "error", 0, 0, row.error or "unreadable row")
            return
        row_id = row.derived_id
        if self.spec.id_column is not None:
            value = row.values.get(self.spec.id_column)
            if value is None:
                self._finish_row(
                    row, None, "error", 0, 0, f"id column {self.spec.id_column!r} is null or missing"
                )
                return
            row_id = str(value)
        if row_id in self.pending:
            self._finish_row(row, None, "error", 0, 0, f"duplicate id {row_id!r}: ids must be unique")
            return
        ids, error = self.builder.build(row.values)
        if ids is None:
            self._finish_row(row, None, "error", 0, 0, error)
            return
        saved = inflight.pop(row.ordinal, None)
        output_ids = None
        if saved is not None and saved.get("id") == row_id and saved.get("prompt_ids") == ids:
            output_ids = saved.get("output_ids") or None
            if self.params.n > 1 and saved.get("samples"):
                output_ids = {int(k): v for k, v in saved["samples"].items()}
        self.ready.append((row_id, ids, output_ids))
        self.pending[row_id] = _Pending(row, row_id, len(ids))

    def _read_ahead(self) -> int:
        """How many prepared rows to hold: a lookahead window to sort, or just what the engine can take."""
        if self.spec.admission in ("longest-first", "shortest-first"):
            return self.spec.lookahead
        return max(0, self.window - self.engine.num_unfinished)

    def _feed(self) -> None:
        """Move prepared rows into the engine while it has room, in the order ``--admission`` asks for."""
        while self.ready and self.engine.num_unfinished < self.window:
            if self.spec.admission in ("longest-first", "shortest-first"):
                pick = max if self.spec.admission == "longest-first" else min
                i = pick(range(len(self.ready)), key=lambda j: len(self.ready[j][1]))
                row_id, ids, output_ids = self.ready[i]
                del self.ready[i]
            else:
                row_id, ids, output_ids = self.ready.popleft()
            if isinstance(output_ids, dict):  # --n, resumed: each sample from its saved tokens (or afresh)
                for k in range(self.params.n):
                    self.engine.add_request(row_id, ids, self.params, output_ids.get(k), sample_index=k)
            else:
                self.engine.add_request(row_id, ids, self.params, output_ids=output_ids)

    def _finished(self, out: Any) -> None:
        p = self.pending[out.request_id]
        self.stats.request(out, p.first_run)
        p.samples[getattr(out, "sample_index", 0)] = out
        if len(p.samples) < self.params.n:
            return  # --n: the row is written once all its samples are done
        del self.pending[out.request_id]
        for k in sorted(p.samples):
            out = p.samples[k]
            error = out.error if out.finish_reason == "error" else None
            if out.finish_reason == "error" and error is None:
                error = "the engine could not run this request"
            text = None if error else out.text
            self._finish_row(
                p.row,
                text,
                out.finish_reason,
                p.num_prompt_tokens,
                len(out.token_ids),
                error,
                [feature_columns(out)],
            )

    def _note_running(self) -> int:
        running = getattr(getattr(self.engine, "scheduler", None), "running", None)
        if running is None:
            return min(self.engine.num_unfinished, self.max_num_seqs)
        now = time.monotonic()
        for req in running:
            p = self.pending.get(getattr(req, "group_id", req.request_id))
            if p is not None and p.first_run is None:
                p.first_run = now
        return len(running)

    # -- the loop -------------------------------------------------------------------------------------

    def run(self) -> JobResult:
        info = self.prep.info
        done = self.manifest.done
        inflight = self.state.load_inflight()
        totals = [count_rows(s) for s in self.prep.sources] if info.total_rows is None else []
        self.stream_hint = info.total_rows or (sum(totals) if totals and None not in totals else None)  # type: ignore[arg-type]
        self.total_hint = self.prep.shard.share(self.stream_hint)
        skip, covered = self.prep.shard.filters(done)
        reader = iter_rows(self.prep.sources, skip=skip, covered=covered)
        reader_done = False
        errors_before = self.manifest.errors
        self.bar = tqdm(
            total=self.total_hint,
            initial=self.manifest.rows,
            unit="row",
            disable=None,
            dynamic_ncols=True,
            desc="batchjob",
        )
        last_checkpoint = time.monotonic()
        try:
            while True:
                while not reader_done and len(self.ready) < self._read_ahead():
                    try:
                        self._admit(next(reader), inflight)
                    except StopIteration as stop:
                        reader_done = True
                        info.total_rows = stop.value
                self._feed()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._finished(out)
                    self.stats.step(self._note_running())
                    elapsed = max(self.stats.elapsed, 1e-9)
                    self.bar.set_postfix_str(
                        f"{self.stats.generated_tokens / elapsed:.1f} tok/s", refresh=False
                    )
                elif reader_done:
                    break
                if self.stop_signal is not None:
                    self.checkpoint()
                    return self._result("interrupted")
                max_errors = self.spec.max_errors
                if max_errors is not None and errors_before + self.stats.errors >= max_errors:
                    self.checkpoint()
                    raise TooManyErrors(
                        f"stopped after {errors_before + self.stats.errors} failed rows (--max-errors "
                        f"{max_errors}); state saved in {self.prep.out_dir}. See the error column; "
                        "raise --max-errors to go on"
                    )
                if len(self.buffer) >= _PART_ROWS:
                    self.commit()
                if time.monotonic() - last_checkpoint >= self.spec.checkpoint_interval:
                    self.checkpoint()
                    last_checkpoint = time.monotonic()
            self.commit()
            info.complete = True
            self.prep.state.save_job(info)
            self.state.clear_inflight()
            self.write_stats()
            return self._result("complete")
        finally:
            self.bar.close()

    def _result(self, status: str) -> JobResult:
        return JobResult(
            status,
            self.prep.out_dir,
            self.manifest.rows,
            self.prep.shard.share(self.prep.info.total_rows) or self.total_hint,
            self.manifest.errors,
            self.stats.to_json(),
        )


def extra_fields(params: Any) -> tuple[Any, ...]:
    """The feature columns a job's results carry, after the result columns."""
    names = []
    if params.n > 1:
        names.append("sample_index")
    if params.choices is not None:
        names.append("choice_logprobs")
    if params.logprobs is not None:
        names.append("logprobs")
    return tuple(EXTRA_FIELDS[n] for n in names)


def feature_columns(out: Any) -> dict[str, Any]:
    """The feature columns of one engine output (JSON text for the nested ones)."""
    choice_lp = getattr(out, "choice_logprobs", None)
    logprobs = getattr(out, "logprobs", None)
    return {
        "sample_index": getattr(out, "sample_index", 0),
        "choice_logprobs": None if choice_lp is None else json.dumps(choice_lp),
        "logprobs": None if logprobs is None else json.dumps([[list(t) for t in top] for top in logprobs]),
    }


def part_prefix(shard: Shard) -> str:
    """Part file names of one worker: ``part-000012.parquet``, or ``part-00003-of-00008-000012.parquet``."""
    return "part-" if shard.single else f"part-{shard.index:05d}-of-{shard.count:05d}-"


def load_engine(spec: JobSpec) -> Any:
    from batchjob.engine import Engine

    return Engine.from_pretrained(
        spec.model,
        dtype=spec.dtype,
        device=spec.device,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        kv_memory_gb=spec.kv_memory_gb,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        enable_prefix_caching=spec.prefix_caching,
        static_batching=spec.admission == "static",
        num_speculative_tokens=spec.num_speculative_tokens,
        cuda_graphs=spec.cuda_graphs,
        compile=spec.compile,
    )


def run_job(spec: JobSpec, engine: Any = None, shard: Shard | None = None) -> JobResult:
    """Run (or resume) a job to completion. Returns its result; raises BatchjobError for what the user can fix.

    SIGTERM and SIGINT stop it cleanly: finished rows are committed, in-flight requests checkpointed, and the
    result's status is ``"interrupted"`` (the CLI exits 75). ``engine``: an already loaded one to reuse.
    ``shard``: run only this worker's share of a job split over several workers sharing ``spec.output``.
    """
    prep = prepare(spec, shard=shard)
    if prep.info.complete:
        manifest = Manifest(prep.state.manifest_file)
        total = prep.shard.share(prep.info.total_rows)
        return JobResult("already complete", prep.out_dir, manifest.rows, total, manifest.errors)
    prep.out_dir.mkdir(parents=True, exist_ok=True)
    prep.state.create()
    state = prep.state
    state.lock()
    try:
        if engine is None:
            faults.point("before_model_load")
            with signals.phase("loading the model"):  # what a start-up signal's message says
                faults.point("during_model_load")
                engine = load_engine(spec)
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        if not prep.resumed and not state.create_job(prep.info):
            # another worker of the job created it first: take its seed and chunk size, if it is the same job
            prep = replace(prepare(spec, shard=shard), state=state)
        plan = plan_prompts(spec, prep.info.schema.names, has_template)
        resolve_chat(spec, has_template)
        if not prep.shard.single:
            prep.state.save_job(prep.info)  # a progress.json: status sees this worker has started
        manifest = Manifest(prep.state.manifest_file)
        PartWriter(prep.out_dir, prep.info.schema, part_prefix(prep.shard)).remove_orphans(manifest.names)
        loop = _Loop(prep, engine, PromptBuilder(plan, engine.tokenizer, engine.max_model_len))
        with _StopOnSignals(loop):
            return loop.run()
    finally:
        state.unlock()


class _StopOnSignals:
    """While running, SIGTERM/SIGINT ask the loop to checkpoint and stop (only the main thread gets signals).

    Before and after, the command's own handlers apply (``batchjob/signals.py``): during start-up a signal
    exits 75 at once, with nothing to save; after the loop it is only noted.
    """

    def __init__(self, loop: _Loop) -> None:
        self.loop = loop
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        faults.point("loop_started")
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.loop.stop_signal is not None:
            print("batchjob: second signal, still saving state...", file=sys.stderr)
        self.loop.stop_signal = signum

    def __exit__(self, *exc: object) -> None:
        signals.finishing()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
