"""The job loop, as its steps: read rows, admit each as its row kind (``rows/``: what requests a row makes and
what their outputs become), feed the engine in the order ``--admission`` asks for, step it and route each
finished request back to its row, commit finished rows as parts and checkpoint the unfinished ones
(``checkpoint.py``), stop cleanly.

Rows are keyed two ways: the id (``--id-column``, else ``"<file>:<row>"``) that the engine and the seeded
sampler see, and the ordinal (the row's position in the input stream) that says what is done. Whatever moment
the process dies at, a resume skips committed ordinals, continues the checkpointed requests from their saved
tokens, and recomputes everything else: because a request's tokens are a pure function of (prompt, seed, id,
position), the result equals an uninterrupted run's. The loop talks to the engine only through
``JobEngine`` (``seam.py``): ``add_request``, ``step``, ``snapshot``, ``has_unfinished``, ``num_unfinished``,
``stats``, ``tokenize``, ``tokenizer``, ``config``. The runner hands it the run's one part writer.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchjob.errors import BatchjobError, ConfigError
from batchjob.io.atomic import write_json
from batchjob.io.fits import column_type, id_text
from batchjob.io.readers import Row
from batchjob.io.sources import ORDINAL_BITS, count_rows
from batchjob.io.writers import PartWriter
from batchjob.job import admission, model_identity
from batchjob.job.ahead import Ahead, Taken, read_rows
from batchjob.job.checkpoint import InFlight, Parts
from batchjob.job.ids import IdIndex
from batchjob.job.inputs import InputChangedError, only_growth, split_ordinal
from batchjob.job.manifest import ErrorCounts, Manifest
from batchjob.job.owned import check_foreign
from batchjob.job.prepare import Prepared
from batchjob.job.progress import Progress
from batchjob.job.prompts import PromptBuilder
from batchjob.job.reasoning import ReasoningTags
from batchjob.job.rows import RowMaker
from batchjob.job.rows.base import Ask, RowWork, refused_outputs
from batchjob.job.rows.columns import part_writer
from batchjob.job.rows.prompt import row_request
from batchjob.job.rows.reasoning import think_tags
from batchjob.job.seam import JobEngine
from batchjob.job.stats import RunStats
from batchjob.job.unchanged import check_inputs_unchanged

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput
    from batchjob.engine.request import RequestState
    from batchjob.job.rows.images import ImagePrompts
    from batchjob.sampling import SamplingParams

# the runner's and the estimate's names for what moved to rows/
__all__ = [
    "EXIT_INTERRUPTED",
    "JobLoop",
    "JobResult",
    "TooManyErrors",
    "part_writer",
    "row_request",
    "think_tags",
]

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT with its state saved; run again to resume
_PART_ROWS = 5000  # commit a part at least this often, checkpoint or not
_LIVE_SECONDS = 5.0  # write stats.json (with the in-flight counts `status` shows) at least this often


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


class JobLoop:
    """One process's run of a job: rows in, the engine kept fed, results and checkpoints out."""

    def __init__(
        self,
        prep: Prepared,
        engine: JobEngine,
        builder: PromptBuilder,
        writer: PartWriter,
        tags: ReasoningTags | None,
        images: ImagePrompts | None = None,
    ) -> None:
        """``writer``: the run's part writer (``part_writer``); ``tags``: the model's think tags
        (``think_tags``), which give a reasoning column and two-phase rows; ``images``: image rows' prompts."""
        self.prep = prep
        self.spec = prep.spec
        self.engine = engine
        self.state = prep.state
        self.manifest = Manifest(self.state.manifest_file)
        params = self.spec.sampling_params(prep.info.job_seed)  # what rows leave out, with per-row params
        width = (
            writer.result[0].type.list_size if self.spec.engine.task == "embed" else 0
        )  # body.dimensions' value
        self.rows = RowMaker(self.spec, engine, builder, params, tags, width, images)  # what each row becomes
        self.ahead = Ahead(self.rows, self.spec.image_workers)  # rows read, being built
        self.parts = Parts(prep.out_dir, self.manifest, writer)
        self.max_num_seqs = int(engine.config.max_num_seqs)
        self.window = max(8, 2 * self.max_num_seqs)
        self.pending: dict[str, RowWork] = {}  # rows prepared or in the engine, by id
        self.ready: deque[RowWork] = deque()  # prepared, not yet in the engine
        # every engine request in flight -> its row, and the part the row gave it (``rows/base.py``)
        self.routes: dict[str, tuple[RowWork, int | None]] = {}
        self.refused: deque[RequestOutput] = deque()  # requests the engine refused at admission, as errors
        self.constraint = _constraint(params)  # the job's own: a refusal of it is the job's, not a row's
        self.stats = RunStats(self.max_num_seqs, engine.stats, lora=bool(self.spec.lora_paths))
        self.stop_signal: int | None = None
        # --id-column: ids checked job-wide, through an on-disk index (derived ids are unique by construction)
        self.ids = IdIndex(self.state.work / "ids.sqlite") if self.spec.id_column is not None else None
        self.id_type = column_type(prep.info.schema, self.spec.id_column)
        self.names = {s.base >> ORDINAL_BITS: s.name for s in prep.sources}
        # How many rows there are: all workers' (None until every input is counted), this worker's share.
        counts = prep.info.row_counts
        for source in prep.sources:
            if counts.get(source.base >> ORDINAL_BITS) is None:
                counts[source.base >> ORDINAL_BITS] = count_rows(source)
        self.stream_hint = None if None in counts.values() else sum(counts.values())  # type: ignore[arg-type]
        self.total_hint = prep.shard.share_of(counts)
        self.reader_done = False  # every row of this worker's share has been read
        self.errors_before = self.manifest.errors  # rows failed in earlier runs (--max-errors counts all)
        # --max-errors counts the job's failed rows: the other workers' too, as they commit them
        others = self.state.other_manifests() if self.spec.max_errors is not None else []
        self.errors_elsewhere = ErrorCounts(others, retrying=self.spec.retry_errors)
        self.failed_elsewhere = self.errors_elsewhere.total()
        self.bar = Progress(self.total_hint, self.manifest.rows, self.manifest.errors, self.max_num_seqs)
        self.last_checkpoint = self.last_live = time.monotonic()

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT while the loop runs: checkpoint and stop after this step."""
        if self.stop_signal is not None:
            print("batchjob: second signal, still saving state...", file=sys.stderr)
        self.stop_signal = signum

    # -- the loop: read, admit, feed, step, commit, checkpoint -----------------------------------

    def run(self) -> JobResult:
        """Run to the end of this worker's rows, or until a signal or --max-errors stops it."""
        try:
            reader = read_rows(self.prep, self.manifest.done, self.manifest.unread, self.ids)
            inflight = self.state.load_inflight()  # the last checkpoint's unfinished rows, by ordinal
            while True:
                self._read(reader, inflight)
                self._feed()
                if self.engine.has_unfinished():
                    self._step()
                elif self.reader_done and not self.ahead:
                    break
                if self.stop_signal is not None:
                    self.checkpoint()
                    return self._result("interrupted")
                self._check_errors()
                self._save_as_due()
            if self.spec.max_errors is not None:  # the others' failed rows committed since the last look
                self.failed_elsewhere = self.errors_elsewhere.total()
                self._check_errors()
            self._complete()
            return self._result("complete")
        finally:
            self._close()

    # -- reading and admitting -------------------------------------------------------------------

    def _read(self, reader: Iterator[Row], inflight: dict[int, InFlight]) -> None:
        """Admit rows in input order until the read-ahead is full or the input ends; meanwhile and after,
        ``ahead`` (``ahead.py``: image rows built on worker threads) holds its depth beyond the next row."""
        while len(self.ready) < self._read_ahead() and self._fill(reader, self.ahead.depth + 1):
            self._admit(self.ahead.pop(), inflight)
        self._fill(reader, self.ahead.depth)

    def _fill(self, reader: Iterator[Row], rows: int) -> bool:
        """Read rows into ``ahead`` until it holds ``rows`` or the input ends; whether it holds any."""
        while len(self.ahead) < rows and self._read_row(reader):
            pass
        return bool(self.ahead)

    def _read_row(self, reader: Iterator[Row]) -> bool:
        """Read the next row into ``ahead``, its id checked; False at the end of the input (then the row
        counts are known: the progress gets its total)."""
        if self.reader_done:
            return False
        try:
            row = next(reader)
        except StopIteration as stop:
            self.reader_done = True
            info = self.prep.info
            info.set_counts(
                {s.base >> ORDINAL_BITS: n for s, n in zip(self.prep.sources, stop.value, strict=True)}
            )
            self.total_hint = self.prep.shard.share_of(info.row_counts)
            self.stream_hint = info.total_rows
            self.bar.set_total(self.total_hint)
            return False
        self.ahead.add(row, *self._row_id(row))  # ids are checked in input order, as rows are read
        if self.ids is not None:
            self.ids.seen(row.ordinal + 1)
        return True

    def _admit(self, read: Taken, inflight: dict[int, InFlight]) -> None:
        """Prepare a row as its kind (``rows/``), with the last checkpoint's work on it; else its error row."""
        row, row_id, error, work = read.row, read.row_id, read.error, None
        if row_id is not None:
            assert row_id not in self.pending, row_id
            work, error = self.rows.make(row, row_id, read.built)
        if work is None:
            self._error_row(row, error)
            return
        work.restore(inflight.pop(row.ordinal, None))
        self.ready.append(work)
        self.pending[work.row_id] = work

    def _row_id(self, row: Row) -> tuple[str | None, str | None]:
        """A row's id, or why it has none: it is unreadable, its id is null, or an earlier row holds it."""
        if row.error is not None or row.values is None:
            return None, row.error or "unreadable row"
        if self.spec.id_column is None:
            return row.derived_id, None
        value = row.values.get(self.spec.id_column)
        if value is None:
            return None, f"id column {self.spec.id_column!r} is null or missing"
        row_id = id_text(value, self.id_type)  # as the column writes it: ids equal there are one
        first = self.ids.first(row_id, row.ordinal) if self.ids is not None else None
        if first is not None:
            seq, index = split_ordinal(first)
            where = f"{self.names.get(seq, f'file #{seq}')}:{index}"
            return None, f"duplicate id {row_id!r}: first used by row {where}; ids must be unique"
        return row_id, None

    # -- feeding and stepping the engine ---------------------------------------------------------

    def _read_ahead(self) -> int:
        """How many prepared rows to hold: a lookahead window to sort, or just what the engine can take."""
        if self.spec.admission in admission.SORTED:
            return self.spec.lookahead
        return max(0, self.window - self.engine.num_unfinished)

    def _feed(self) -> None:
        """Move prepared rows into the engine while it has room, in the order ``--admission`` asks for."""
        while self.ready and self.engine.num_unfinished < self.window:
            i = admission.next_index(self.spec.admission, [len(w.prompt_ids) for w in self.ready])
            work = self.ready[i]
            del self.ready[i]
            self._ask(work, work.asks())
        self._settle_refused()

    def _ask(self, work: RowWork, asks: list[Ask]) -> None:
        """Give the engine a row's requests, each routed back to the row with its part."""
        extra: dict[str, Any] = {"adapter": work.adapter} if work.adapter is not None else {}  # (never set
        if work.images is not None:  # for engines without adapters or images)
            extra["images"] = work.images
        for a in asks:
            self.routes[a.request_id] = (work, a.part)
            work.request_ids.append(a.request_id)
            try:
                self.engine.add_request(
                    a.request_id,
                    a.prompt_ids,
                    a.params,
                    a.output_ids,
                    sample_index=a.sample_index,
                    continuation_ids=a.continuation_ids,
                    token_logprobs=a.token_logprobs,
                    **extra,
                )
            except ConfigError as e:  # e.g. labels its tokenizer makes alike, a grammar it can't compile
                if _constraint(a.params) == self.constraint:
                    raise  # the job's own setting: a setup error (refused before work where it can be)
                self.refused += refused_outputs(
                    a, f"{work.row.place}: the engine can't run this row's parameters: {e}"
                )

    def _settle_refused(self) -> None:
        """The requests the engine refused at admission, finished as errors of their rows (a follow-up a row
        asks for then, if refused too, joins them)."""
        while self.refused:
            self._finished(self.refused.popleft())

    def _step(self) -> None:
        """One engine step; its finished requests become result rows."""
        for out in self.engine.step():
            self._finished(out)
        self._settle_refused()  # follow-ups the rows just asked for
        self.stats.step(self.engine.stats)
        self.bar.step(self.stats.generated_tokens)

    def _finished(self, out: RequestOutput) -> None:
        """A request finished: its row asks for what follows it, or counts it, and once done is written."""
        work, part = self.routes[out.request_id]
        follow = work.finished(out, part)
        if follow:  # a step of the row (a reasoning sample's thinking), not one of its results
            self._ask(work, follow)
            return
        self.stats.request(out)
        if not work.done:
            return  # --n, several inputs: the row is written once all its requests are done
        del self.pending[work.row_id]
        for request_id in work.request_ids:
            self.routes.pop(request_id, None)
        self._finish_samples(
            work.row, work.num_prompt_tokens, work.results(), work.num_images, work.restored_tokens
        )

    # -- committing and checkpointing ------------------------------------------------------------

    def _error_row(self, row: Row, error: str | None) -> None:
        """Buffer the one result row of a row that fails before any request (unreadable, no id, no prompt)."""
        sample = {"generated_text": None, "finish_reason": "error", "num_generated_tokens": 0, "error": error}
        self._finish_samples(row, 0, [sample | {"sample_index": 0}], unread=row.unread)

    def _finish_samples(
        self,
        row: Row,
        n_prompt: int,
        samples: list[dict[str, Any]],
        images: int = 0,
        restored: int = 0,
        unread: bool = False,
    ) -> None:
        """Buffer an input row's result rows, one per sample (``generated_text``, ``finish_reason``,
        ``num_generated_tokens``, ``error`` and the feature columns each), and count it: one input row, its
        prompt once, however many samples (--n) it has; an error in any sample makes it a failed row. The
        run's tokens leave out the ``restored`` ones: an earlier run generated them."""
        self.parts.add(row.ordinal, {"values": row.values, "num_prompt_tokens": n_prompt}, samples, unread)
        failed = any(s["error"] is not None for s in samples)
        tokens = sum(s["num_generated_tokens"] for s in samples) - restored
        adapter = samples[0].get("adapter") if samples else None  # (an error row before any request: none)
        self.stats.row(n_prompt, tokens, failed, len(samples), images, adapter)
        self.bar.row(failed)

    def commit(self) -> None:
        self.parts.commit()

    def checkpoint(self) -> None:
        """Commit finished rows, then save the unfinished ones; both atomic, in this order."""
        self.parts.commit()
        requests = self._in_flight()
        if self.ids is not None:
            self.ids.commit()  # ids read so far (other workers' rows too) need not be read again next time
        self.state.save_inflight(requests)
        self.write_stats()

    def _in_flight(self) -> list[InFlight]:
        """Every unfinished row's work, as its kind saves it: the rows in the engine (their requests' states,
        with the part each was asked as), then those restored by the last checkpoint and not yet re-added."""
        states: dict[str, tuple[RowWork, list[tuple[int | None, RequestState]]]] = {}
        for snap in self.engine.snapshot():
            work, part = self.routes[snap.request_id]
            states.setdefault(work.row_id, (work, []))[1].append((part, snap))
        records = [work.in_flight(own) for work, own in states.values()]
        records += [work.in_flight([]) for work in self.ready]
        return [r for r in records if r is not None]

    def write_stats(self) -> None:
        body = self.stats.to_json(self.engine.stats.as_dict())
        finished = len({r["ordinal"] for r in self.parts.buffer})
        body["live"] = {  # what `status` shows of a running job beyond its committed rows
            "updated": time.time(),
            "finished_uncommitted": finished,  # input rows finished, not yet in a committed part
            "committed_rows": self.manifest.rows,  # the manifest's now: rows it takes later were counted here
            "in_engine": len(self.pending) - len(self.ready),  # input rows being generated
            "read_ahead": len(self.ready) + len(self.ahead),  # input rows read, not yet in the engine
        }
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

    def _check_errors(self) -> None:
        """--max-errors: stop, with the state saved, once that many rows of the job have failed (this run
        and before, and those the other workers have committed, as last looked at)."""
        max_errors = self.spec.max_errors
        mine = self.errors_before + self.stats.errors
        failed = mine + self.failed_elsewhere
        if max_errors is not None and failed >= max_errors:
            self.checkpoint()
            where = ""
            if self.failed_elsewhere:
                where = f" in the job ({mine} in this worker's share, {self.failed_elsewhere} in the others')"
            raise TooManyErrors(
                f"stopped after {failed} failed rows{where} (--max-errors {max_errors}); state saved in "
                f"{self.prep.out_dir}. See the error column; raise --max-errors to go on"
            )

    def _save_as_due(self) -> None:
        """Commit a part once enough rows wait; the live stats and the checkpoint at their intervals."""
        if len(self.parts.buffer) >= _PART_ROWS:
            self.commit()
        if time.monotonic() - self.last_live >= min(_LIVE_SECONDS, self.spec.checkpoint_interval):
            self.write_stats()  # a running job's progress for `status`, between checkpoints
            self.last_live = time.monotonic()
        if time.monotonic() - self.last_checkpoint >= self.spec.checkpoint_interval:
            self.checkpoint()
            self.failed_elsewhere = self.errors_elsewhere.total()
            self.last_checkpoint = self.last_live = time.monotonic()

    # -- ending ----------------------------------------------------------------------------------

    def _complete(self) -> None:
        """Every row is done: commit the last part, mark the job complete, drop the in-flight checkpoint."""
        try:
            check_inputs_unchanged(self.prep)  # a job is complete only for the inputs it recorded
        except InputChangedError as e:
            if only_growth(e.problems):  # files added or grown: the rows done are of the files as recorded,
                self.checkpoint()  # so they are kept for the --append run (a changed file's rows are not)
            raise
        self.commit()
        if self.ids is not None:
            self.ids.commit()
        check_foreign(self.prep.out_dir)  # put there while it ran: the rows are kept, "complete" is not said
        self.prep.info.mark_complete()
        self.state.save_job(self.prep.info)
        self.state.clear_inflight()
        self.write_stats()

    def _close(self) -> None:
        """However the run ends: close the progress and the id index; say which body.model names were
        ignored."""
        self.bar.close()
        self.ahead.close()
        if self.ids is not None:
            self.ids.close()
        other = sorted(self.rows.models_seen - self.rows.model_names)
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


def _constraint(params: SamplingParams | None) -> tuple[Any, ...]:
    """What of a request's parameters the engine compiles at admission: its labels, schema or regex."""
    return (None, None, None) if params is None else (params.choices, params.json_schema, params.regex)
