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
from types import SimpleNamespace
from typing import Any

from batchjob import faults, signals
from batchjob.errors import BatchjobError, ConfigError, InputError
from batchjob.io.atomic import write_json
from batchjob.io.readers import Row, compatible, input_schema, iter_rows
from batchjob.io.sources import ORDINAL_BITS, Source, count_rows, discover
from batchjob.io.writers import EXTRA_FIELDS, PartWriter
from batchjob.job import model_identity
from batchjob.job.ids import IdIndex
from batchjob.job.inputs import InputChangedError, new_records, ordered_sources, reconcile, split_ordinal
from batchjob.job.intervals import IntervalSet
from batchjob.job.manifest import Manifest, PartRecord
from batchjob.job.progress import Progress
from batchjob.job.prompts import PromptBuilder, PromptPlan, plan_prompts, resolve_chat
from batchjob.job.reasoning import find_tags, parse_tags
from batchjob.job.requests import params_from_column, parse_request
from batchjob.job.shard import Shard, choose_chunk_rows
from batchjob.job.spec import JobSpec
from batchjob.job.state import STATE_DIR, JobInfo, JobMismatchError, StateDir, fingerprint_changes
from batchjob.job.stats import RunStats
from batchjob.job.verify import needs_repair, repair_outputs
from batchjob.sampling import SamplingParams

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
    taken: list[str] = field(default_factory=list)  # --append: a line per grown or new input file
    model_check: dict[str, Any] | None = None  # a saved model identity to compare once the model is loaded


def model_names(model: str | None) -> set[str]:
    """The names a request may give this job's model (``--check-model-name``)."""
    from batchjob.models import DEFAULT_MODEL

    names = {model_identity.display_name(model)}
    if model not in (None, "", "default"):
        names.add(str(model))
    if DEFAULT_MODEL in names:
        names.add(f"HuggingFaceTB/{DEFAULT_MODEL}")
    return names


def model_fingerprint(model: str | None) -> dict[str, Any]:
    """The model's identity by content (``model_identity.py``), whatever it is called."""
    from batchjob.models import resolve_model

    resolved = resolve_model(model)
    return model_identity.identity(model_identity.model_files(resolved), resolved, model)


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


def input_paths(spec: JobSpec) -> list[str]:
    """The --input values, local ones made absolute: where ``batchjob status`` looks at the inputs again."""
    return [p if "://" in p else os.path.abspath(os.path.expanduser(p)) for p in spec.input]


def _changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a saved job's fingerprint and this run's, in words."""
    saved = {"sharding": {"num_shards": 1}} | saved
    model = model_identity.changes(saved.get("model", {}).get("identity", {}), now["model"]["identity"])

    def without_identity(fp: dict[str, Any]) -> dict[str, Any]:
        return fp | {"model": {"dtype": fp.get("model", {}).get("dtype")}}

    return ([model] if model else []) + fingerprint_changes(without_identity(saved), without_identity(now))


def prepare(spec: JobSpec, has_chat_template: bool = True, shard: Shard | None = None) -> Prepared:
    """Check the job against its inputs and saved state, without loading the model.

    ``shard``: this worker's share of a job split over several workers (default: the whole job).
    """
    spec.require_io()
    shard = shard or Shard()
    out_dir = Path(spec.output)  # type: ignore[arg-type]
    _check_output(out_dir)
    found = discover(spec.input, exclude=out_dir)
    state = StateDir(out_dir, shard)
    saved = state.load_job() if state.exists() else None
    taken: list[str] = []
    if saved is None:
        schema = input_schema(found)
        records = new_records(found)
    else:
        schema = saved.schema
        records, taken = reconcile(saved.inputs, found, spec.append, out_dir)
        known = {r.name for r in saved.inputs}
        misfits = [
            f"{s.path}: {why}"
            for s in found
            if s.name not in known and (why := compatible(schema, s)) is not None
        ]
        if misfits:
            raise InputChangedError(
                "new input files don't fit the job's columns:\n  " + "\n  ".join(misfits)
                + "\nPut data with other columns in a job of its own (a new --output)"
            )
    sources = ordered_sources(found, records)
    plan = plan_prompts(spec, schema.names, has_chat_template)
    fingerprint = {
        "model": {"identity": model_fingerprint(spec.model), "dtype": spec.dtype},
        "prompt": spec.prompt_fingerprint() | {"resolved_column": plan.column},
        "sampling": spec.sampling_fingerprint(),
        "sharding": {"num_shards": shard.count},
    }
    if saved is not None:
        deferred = None
        saved_identity = saved.fingerprint.get("model", {}).get("identity", {})
        if "hub_id" in fingerprint["model"]["identity"] and "content" in saved_identity:
            # the hub model is not on this machine now: compare it by content once it is loaded
            deferred = saved_identity
            fingerprint["model"]["identity"] = saved_identity
        changes = _changes(saved.fingerprint, fingerprint)
        if changes:
            raise JobMismatchError(
                f"--output {out_dir} holds a different job; changed: {'; '.join(changes)}. "
                "Use the original options to resume, or a new --output folder"
            )
        shard = replace(shard, chunk_rows=saved.chunk_rows or shard.chunk_rows)
        saved.inputs = records
        if taken:
            saved.input_paths = input_paths(spec)
        return Prepared(spec, out_dir, state, sources, saved, True, plan, shard, taken, deferred)
    info = JobInfo(fingerprint, random.getrandbits(62), schema, records, input_paths=input_paths(spec))
    if not shard.single:
        info.chunk_rows = choose_chunk_rows(info.total_rows, shard.count)
        shard = replace(shard, chunk_rows=info.chunk_rows)
    return Prepared(spec, out_dir, state, sources, info, False, plan, shard)


@dataclass
class _Pending:
    row: Row
    row_id: str
    num_prompt_tokens: int
    params: SamplingParams  # of the row's request in the engine (with reasoning: of its thinking)
    samples: dict[int, Any] = field(default_factory=dict)  # --n: finished samples, written together
    # reasoning models (reasoning.py): whether the prompt ends inside a think block; with two requests, the
    # thinking's prompt, the answer's parameters, and each sample's finished thinking
    inside: bool = False
    prompt: list[int] = field(default_factory=list)
    answer_params: SamplingParams | None = None
    thoughts: dict[int, Any] = field(default_factory=dict)


class _Loop:
    """One process's run of a job."""

    def __init__(self, prep: Prepared, engine: Any, builder: PromptBuilder) -> None:
        self.prep = prep
        self.spec = prep.spec
        self.engine = engine
        self.builder = builder
        self.state = prep.state
        self.manifest = Manifest(self.state.manifest_file)
        self.params = self.spec.sampling_params(prep.info.job_seed)  # what rows leave out, with per-row params
        given = parse_tags(self.spec.reasoning_tags) if self.spec.reasoning_tags else None
        self.tags = find_tags(engine.tokenizer, given)  # think tags: a reasoning column, two-phase rows
        if self.tags is None and self.spec.max_reasoning_tokens is not None:
            raise ConfigError(
                "--max-reasoning-tokens needs the model's think tags, and its tokenizer names none: give them "
                "with --reasoning-tags OPEN,CLOSE"
            )
        self.answer_of: dict[str, tuple[str, int]] = {}  # an answer request -> (its row's id, sample index)
        extra = extra_fields(self.params, every=self.spec.per_row_params, reasoning=self.tags is not None)
        self.writer = PartWriter(prep.out_dir, prep.info.schema, part_prefix(prep.shard), extra)
        self.model_names = model_names(self.spec.model)  # --format openai: what body.model may say
        self.models_seen: set[str] = set()
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
        # --id-column: ids checked job-wide, through an on-disk index (derived ids are unique by construction)
        self.ids = IdIndex(self.state.work / "ids.sqlite") if self.spec.id_column is not None else None
        self.names = {s.base >> ORDINAL_BITS: s.name for s in prep.sources}

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
        self.bar.row(error is not None)

    def commit(self) -> None:
        if not self.buffer:
            return
        rows = sorted(self.buffer, key=lambda r: (r["ordinal"], r.get("sample_index", 0)))
        name = self.writer.write(self.writer.next_seq(self.manifest.names), rows)
        self.manifest.append(
            PartRecord(
                name=name,
                rows=len({r["ordinal"] for r in rows}),  # input rows (--n writes several result rows each)
                errors=sum(r["error"] is not None for r in rows),
                prompt_tokens=sum(r["num_prompt_tokens"] or 0 for r in rows),
                generated_tokens=sum(r["num_generated_tokens"] or 0 for r in rows),
                ordinals=self.buffer_ordinals.ranges(),
                size=self.writer.size(name),
                result_rows=len(rows),
            )
        )
        self.buffer = []
        self.buffer_ordinals = IntervalSet()
        faults.point("part_committed")

    def checkpoint(self) -> None:
        """Commit finished rows, then save the unfinished requests; both atomic, in this order."""
        self.commit()
        requests = []
        by_id: dict[str, dict[str, Any]] = {}
        for snap in self.engine.snapshot():
            if snap.request_id in self.answer_of:  # saved as its finished thinking: the answer is redone
                row_id, k = self.answer_of[snap.request_id]
                p = self.pending[row_id]
                thought = p.thoughts[k]
                snap = SimpleNamespace(
                    request_id=row_id, prompt_ids=p.prompt, output_ids=thought.token_ids, sample_index=k
                )
            p = self.pending[snap.request_id]
            record = {"ordinal": p.row.ordinal, "id": snap.request_id, "prompt_ids": list(snap.prompt_ids)}
            if self.spec.per_row_params:
                record["params"] = p.params.to_dict()
            if p.params.n == 1:
                requests.append(record | {"output_ids": list(snap.output_ids)})
                continue
            # --n: one record per row, the unfinished samples' tokens by sample index (finished ones
            # that wait for their siblings are recomputed on resume: same tokens, they are seeded).
            record = by_id.setdefault(snap.request_id, record | {"samples": {}})
            record["samples"][str(snap.sample_index)] = list(snap.output_ids)
        requests += by_id.values()
        if self.ids is not None:
            self.ids.commit()  # ids read so far (other workers' rows too) need not be read again next time
        for row_id, ids, output_ids in self.ready:  # restored from the last checkpoint, not yet re-added
            if output_ids:
                p = self.pending[row_id]
                record = {"ordinal": p.row.ordinal, "id": row_id, "prompt_ids": ids}
                if self.spec.per_row_params:
                    record["params"] = p.params.to_dict()
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
            "rows_total": self.total_hint,  # this worker's share
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
            first = self.ids.first(row_id, row.ordinal) if self.ids is not None else None
            if first is not None:
                seq, index = split_ordinal(first)
                where = f"{self.names.get(seq, f'file #{seq}')}:{index}"
                self._finish_row(
                    row, None, "error", 0, 0, f"duplicate id {row_id!r}: first used by row {where}; ids must be unique"
                )
                return
        assert row_id not in self.pending, row_id
        params, ids, error = self._request(row)
        if ids is None or params is None:
            self._finish_row(row, None, "error", 0, 0, error)
            return
        pending = _Pending(row, row_id, len(ids), params)
        if self.tags is not None:
            pending.inside = self.tags.inside(ids)
            closed = not pending.inside and self.tags.closed(ids)  # the template turned thinking off
            if not closed and (params.constrained or self.spec.max_reasoning_tokens is not None):
                ids = ids if pending.inside else ids + list(self.tags.open_ids)
                pending.prompt, pending.answer_params = ids, params
                pending.params = params = self._thinking_params(params)
        saved = inflight.pop(row.ordinal, None)
        output_ids = None
        if (
            saved is not None
            and saved.get("id") == row_id
            and saved.get("prompt_ids") == ids
            and saved.get("params", params.to_dict()) == params.to_dict()
        ):
            output_ids = saved.get("output_ids") or None
            if params.n > 1 and saved.get("samples"):
                output_ids = {int(k): v for k, v in saved["samples"].items()}
        self.ready.append((row_id, ids, output_ids))
        self.pending[row_id] = pending

    def _thinking_params(self, params: SamplingParams) -> SamplingParams:
        """A row's thinking: unconstrained, until the close tag or --max-reasoning-tokens (else
        --max-new-tokens) tokens; its answer gets the row's own parameters after it."""
        assert self.tags is not None
        one = len(self.tags.close_ids) == 1
        return params.replace(
            choices=None,
            json_schema=None,
            regex=None,
            logprobs=None,
            max_new_tokens=self.spec.max_reasoning_tokens or params.max_new_tokens,
            stop=None if one else [self.tags.close],
            stop_token_ids=list(self.tags.close_ids) if one else None,
        )

    def _request(self, row: Row) -> tuple[SamplingParams | None, list[int] | None, str | None]:
        """A row's sampling parameters and prompt ids, or the reason it has none (naming line and field)."""
        if self.spec.format == "openai" and row.values is not None:
            body = row.values.get("body")
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                self.models_seen.add(body["model"])
        check = self.model_names if self.spec.check_model_name else None
        return row_request(self.spec, self.builder, self.params, row, check)

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
            params = self.pending[row_id].params
            if isinstance(output_ids, dict):  # --n, resumed: each sample from its saved tokens (or afresh)
                for k in range(params.n):
                    self.engine.add_request(row_id, ids, params, output_ids.get(k), sample_index=k)
            else:
                self.engine.add_request(row_id, ids, params, output_ids=output_ids)

    def _finished(self, out: Any) -> None:
        if out.request_id in self.answer_of:  # a reasoning row's answer
            row_id, k = self.answer_of.pop(out.request_id)
            p = self.pending[row_id]
        else:
            row_id, k = out.request_id, getattr(out, "sample_index", 0)
            p = self.pending[row_id]
            if p.answer_params is not None and out.finish_reason != "error":
                self._answer(p, k, out)  # the thinking is done: now the answer, after it
                return
        self.stats.request(out)
        p.samples[k] = out
        if len(p.samples) < p.params.n:
            return  # --n: the row is written once all its samples are done
        del self.pending[row_id]
        for k in sorted(p.samples):
            out = p.samples[k]
            error = out.error if out.finish_reason == "error" else None
            if out.finish_reason == "error" and error is None:
                error = "the engine could not run this request"
            text, reasoning, n_gen = None if error else out.text, None, len(out.token_ids)
            thought = p.thoughts.get(k)
            if self.tags is not None and text is not None:
                if thought is not None:  # two requests: the thinking's text, then the answer's
                    reasoning = self.tags.split(thought.text, inside=True)[0] or ""
                    n_gen += len(thought.token_ids)
                else:
                    reasoning, text = self.tags.split(text, p.inside)
            self._finish_row(
                p.row,
                text,
                out.finish_reason,
                p.num_prompt_tokens,
                n_gen,
                error,
                [feature_columns(out) | {"reasoning": reasoning}],
            )

    def _answer(self, p: _Pending, k: int, thought: Any) -> None:
        """Queue sample ``k``'s answer: the prompt, its thinking and the close tag (added if it ran long)."""
        assert self.tags is not None and p.answer_params is not None
        p.thoughts[k] = thought
        ids = p.prompt + list(thought.token_ids)
        close = list(self.tags.close_ids)
        if ids[-len(close) :] != close:
            ids += close
        answer_id = f"{p.row_id}\x1fanswer{k}"
        self.answer_of[answer_id] = (p.row_id, k)
        self.engine.add_request(answer_id, ids, p.answer_params.replace(n=1))

    # -- the loop -------------------------------------------------------------------------------------

    def run(self) -> JobResult:
        info = self.prep.info
        done = self.manifest.done
        inflight = self.state.load_inflight()
        counts = info.row_counts
        for source in self.prep.sources:
            if counts.get(source.base >> ORDINAL_BITS) is None:
                counts[source.base >> ORDINAL_BITS] = count_rows(source)
        self.stream_hint = None if None in counts.values() else sum(counts.values())  # type: ignore[arg-type]
        self.total_hint = self.prep.shard.share_of(counts)
        skip, covered = self.prep.shard.filters(done)
        on_skipped = None
        if self.ids is not None:
            ids = self.ids
            seen_to = ids.seen_to

            def on_skipped(ordinal: int, value: Any) -> None:  # rows of other workers, or done already
                if ordinal >= seen_to and value is not None:
                    ids.first(str(value), ordinal)
                ids.seen(ordinal + 1)

        reader = iter_rows(
            self.prep.sources, skip=skip, covered=covered, on_skipped=on_skipped, id_column=self.spec.id_column
        )
        reader_done = False
        errors_before = self.manifest.errors
        self.bar = Progress(self.total_hint, self.manifest.rows, self.manifest.errors)
        last_checkpoint = time.monotonic()
        try:
            while True:
                while not reader_done and len(self.ready) < self._read_ahead():
                    try:
                        row = next(reader)
                    except StopIteration as stop:
                        reader_done = True
                        info.set_counts(
                            {s.base >> ORDINAL_BITS: n for s, n in zip(self.prep.sources, stop.value, strict=True)}
                        )
                        self.total_hint = self.prep.shard.share_of(info.row_counts)
                        self.stream_hint = info.total_rows
                        self.bar.set_total(self.total_hint)
                    else:
                        self._admit(row, inflight)
                        if self.ids is not None:
                            self.ids.seen(row.ordinal + 1)
                self._feed()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._finished(out)
                    self.stats.step(self.engine.num_running, getattr(self.engine, "stats", None))
                    self.bar.step(self.stats.generated_tokens)
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
            if self.ids is not None:
                self.ids.commit()
            info.mark_complete()
            self.prep.state.save_job(info)
            self.state.clear_inflight()
            self.write_stats()
            return self._result("complete")
        finally:
            self.bar.close()
            if self.ids is not None:
                self.ids.close()
            other = sorted(self.models_seen - self.model_names)
            if other and not self.spec.check_model_name:
                print(
                    f"batchjob: body.model ignored: the requests name {', '.join(map(repr, other))}, this job "
                    f"runs {model_identity.display_name(self.spec.model)!r} (--check-model-name makes such "
                    "requests errors)",
                    file=sys.stderr,
                )

    def _result(self, status: str) -> JobResult:
        return JobResult(
            status,
            self.prep.out_dir,
            self.manifest.rows,
            self.total_hint,
            self.manifest.errors,
            self.stats.to_json(),
        )


def row_request(
    spec: JobSpec, builder: PromptBuilder, base: SamplingParams, row: Row, model_names: set[str] | None = None
) -> tuple[SamplingParams | None, list[int] | None, str | None]:
    """A row's sampling parameters (``base`` and what the row brings) and prompt ids, or the reason it has
    none, naming the line and the field. ``model_names``: what ``body.model`` may say (--check-model-name)."""
    assert row.values is not None
    where = f"{row.source} line {row.line}: " if row.line is not None else ""
    params: SamplingParams | None = base
    if spec.format == "openai":
        request, params, error = parse_request(row.values, base, model_names)
        if request is None:
            return None, None, where + str(error)
        ids, error = builder.build_request(request)
        return params, ids, error
    if spec.params_column is not None:
        params, error = params_from_column(row.values.get(spec.params_column), spec.params_column, base)
        if params is None:
            return None, None, where + str(error)
    ids, error = builder.build(row.values)
    return params, ids, error


def extra_fields(params: Any, every: bool = False, reasoning: bool = False) -> tuple[Any, ...]:
    """The feature columns a job's results carry, after the result columns (``every``: all of them, for
    jobs whose rows choose their own parameters; ``reasoning``: a model that thinks in tags)."""
    names = ["reasoning"] if reasoning else []
    if every:
        return tuple(EXTRA_FIELDS[n] for n in names) + tuple(
            f for n, f in EXTRA_FIELDS.items() if n != "reasoning"
        )
    if params.n > 1:
        names.append("sample_index")
    if params.choices is not None:
        names += ["choice_logprobs", "choice_probs"]
    if params.logprobs is not None:
        names.append("logprobs")
    return tuple(EXTRA_FIELDS[n] for n in names)


def feature_columns(out: Any) -> dict[str, Any]:
    """The feature columns of one engine output (JSON text for the nested ones)."""
    choice_lp = getattr(out, "choice_logprobs", None)
    choice_p = getattr(out, "choice_probs", None)
    logprobs = getattr(out, "logprobs", None)
    return {
        "sample_index": getattr(out, "sample_index", 0),
        "choice_logprobs": None if choice_lp is None else json.dumps(choice_lp),
        "choice_probs": None if choice_p is None else json.dumps(choice_p),
        "logprobs": None if logprobs is None else json.dumps([[list(t) for t in top] for top in logprobs]),
    }


def part_prefix(shard: Shard) -> str:
    """Part file names of one worker: ``part-000012.parquet``, or ``part-00003-of-00008-000012.parquet``."""
    return "part-" if shard.single else f"part-{shard.index:05d}-of-{shard.count:05d}-"


def _engine_options(spec: JobSpec) -> dict[str, Any]:
    """The spec's engine settings, as ``Engine.from_pretrained`` and ``EngineConfig`` name them."""
    return dict(
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
        max_model_len=spec.max_model_len,
        # A job always wants a pool that fits one request of the full context, however it was sized: a
        # smaller one would turn rows into errors for a reason that is about the setup, not the row.
        check_kv_pool=True,
    )


def load_engine(spec: JobSpec) -> Any:
    from batchjob.engine import Engine

    return Engine.from_pretrained(
        spec.model, trust_remote_code=spec.trust_remote_code, **_engine_options(spec)
    )


def check_engine(spec: JobSpec) -> str:
    """What ``load_engine`` refuses, checked from the model's config without its weights: code the model
    ships (without ``trust_remote_code``), a model family or feature the attention would get wrong,
    ``max_model_len`` beyond the model's context, a KV pool that can't hold one request of the context.
    Returns a line saying what the engine will get."""
    from batchjob.engine.config import EngineConfig, resolve_device, resolve_dtype
    from batchjob.engine.kv_cache import KVShape
    from batchjob.engine.support import check_supported
    from batchjob.models import load_config

    model_config, _ = load_config(spec.model, spec.trust_remote_code)
    check_supported(model_config)
    options = _engine_options(spec)
    device = resolve_device(options.pop("device"))
    config = EngineConfig(device=device, dtype=resolve_dtype(options.pop("dtype"), device), **options)
    max_len = config.resolve_max_model_len(model_config)
    blocks = config.planned_num_blocks(KVShape.from_config(model_config), max_len)
    if blocks is None:
        return (
            f"context {max_len} tokens; the KV pool is sized at load by profiling {device} memory, and "
            "checked then to hold one request of that context"
        )
    config.check_kv_fits(blocks, max_len)
    return (
        f"context {max_len} tokens; KV pool {blocks} blocks x {config.block_size} tokens = "
        f"{blocks * config.block_size} tokens (sized by {config.kv_pool_source})"
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
        if not needs_repair(prep.out_dir, manifest, spec.retry_errors):  # else: redo those rows, below
            total = prep.shard.share_of(prep.info.row_counts)
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
        _settle_model(prep, engine)
        if not prep.resumed and not state.create_job(prep.info):
            # another worker of the job created it first: take its seed and chunk size, if it is the same job
            prep = replace(prepare(spec, shard=shard), state=state)
            _settle_model(prep, engine)
        if prep.taken:
            prep = _take_in(prep, spec, shard)
        plan = plan_prompts(spec, prep.info.schema.names, has_template)
        resolve_chat(spec, has_template)
        if not prep.shard.single:
            prep.state.save_job(prep.info)  # a progress.json: status sees this worker has started
        manifest = Manifest(prep.state.manifest_file)
        extra = extra_fields(spec.sampling_params(prep.info.job_seed))
        writer = PartWriter(prep.out_dir, prep.info.schema, part_prefix(prep.shard), extra)
        repair_outputs(prep.state, prep.info, manifest, writer, spec.retry_errors)  # verify.py
        writer.remove_orphans(manifest.names)
        builder = PromptBuilder(plan, engine.tokenizer, engine.max_model_len, spec.template_kwargs)
        loop = _Loop(prep, engine, builder)
        with _StopOnSignals(loop):
            return loop.run()
    finally:
        state.unlock()


def _settle_model(prep: Prepared, engine: Any) -> None:
    """A model named by a hub id that was not on this machine before loading: identify it now, by content."""
    model = prep.info.fingerprint["model"]
    hub_id = model["identity"].get("hub_id") or (prep.model_check and engine.model_id)
    if not hub_id:
        return
    now = model_identity.identity(model_identity.model_files(engine.model_id or hub_id), hub_id)
    if prep.model_check is not None:
        change = model_identity.changes(prep.model_check, now)
        if change:
            raise JobMismatchError(
                f"--output {prep.out_dir} holds a different job; changed: {change}. "
                "Use the original model to resume, or a new --output folder"
            )
    else:
        model["identity"] = now


def _take_in(prep: Prepared, spec: JobSpec, shard: Shard | None) -> Prepared:
    """--append: save the records of grown and new input files before any of their rows is read."""
    state = prep.state
    if not prep.shard.single:
        with state.job_lock():  # workers appending at once: each checks against what the others saved
            prep = replace(prepare(spec, shard=shard), state=state)
            if prep.taken:
                state.save_inputs(prep.info)
    else:
        state.save_job(prep.info)
    for line in prep.taken:
        print(f"batchjob: --append: {line}", file=sys.stderr)
    return prep


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
