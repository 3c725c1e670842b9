"""The job loop: read rows, build their prompts, keep the engine fed in the order ``--admission`` asks
for, turn finished requests into result rows, commit and checkpoint (``checkpoint.py``), stop cleanly.

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
from batchjob.io.readers import Row, iter_rows
from batchjob.io.sources import ORDINAL_BITS, count_rows
from batchjob.io.writers import EXTRA_FIELDS, PartWriter
from batchjob.job import admission, model_identity
from batchjob.job.checkpoint import InFlight, Parts
from batchjob.job.ids import IdIndex
from batchjob.job.inputs import split_ordinal
from batchjob.job.manifest import Manifest
from batchjob.job.prepare import Prepared
from batchjob.job.progress import Progress
from batchjob.job.prompts import PromptBuilder
from batchjob.job.reasoning import ReasoningTags, find_tags, parse_tags
from batchjob.job.requests import params_from_column, parse_embeddings_request, parse_request
from batchjob.job.seam import JobEngine
from batchjob.job.shard import Shard
from batchjob.job.spec import JobSpec
from batchjob.job.stats import RunStats
from batchjob.job.tasks import result_fields, task_columns, task_extra
from batchjob.job.unchanged import check_inputs_unchanged
from batchjob.sampling import SamplingParams

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput

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


def model_names(model: str | None) -> set[str]:
    """The names a request may give this job's model (``--check-model-name``)."""
    from batchjob.models import DEFAULT_MODEL

    names = {model_identity.display_name(model)}
    if model not in (None, "", "default"):
        names.add(str(model))
    if DEFAULT_MODEL in names:
        names.add(f"HuggingFaceTB/{DEFAULT_MODEL}")
    return names


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
    continuation: list[int] | None = None  # --task score --score-column: the scored text's ids
    inputs: list[list[int]] | None = None  # --task embed --format openai: each of body.input's token ids


class JobLoop:
    """One process's run of a job: rows in, the engine kept fed, results and checkpoints out."""

    def __init__(
        self,
        prep: Prepared,
        engine: JobEngine,
        builder: PromptBuilder,
        writer: PartWriter,
        tags: ReasoningTags | None,
    ) -> None:
        """``writer``: the run's part writer (``part_writer``); ``tags``: the model's think tags
        (``think_tags``), which give a reasoning column and two-phase rows."""
        self.prep = prep
        self.spec = prep.spec
        self.engine = engine
        self.builder = builder
        self.state = prep.state
        self.manifest = Manifest(self.state.manifest_file)
        self.params = self.spec.sampling_params(
            prep.info.job_seed
        )  # what rows leave out, with per-row params
        self.tags = tags
        self.answer_of: dict[str, tuple[str, int]] = {}  # an answer request -> (its row's id, sample index)
        self.task = self.spec.task
        # --task embed: body.dimensions' only value
        self.width = writer.result[0].type.list_size if self.task == "embed" else 0
        self.input_of: dict[str, tuple[str, int]] = {}  # an embeddings request's input -> (row id, index)
        self.parts = Parts(prep.out_dir, self.manifest, writer)
        self.model_names = model_names(self.spec.model)  # --format openai: what body.model may say
        self.models_seen: set[str] = set()
        self.max_num_seqs = int(engine.config.max_num_seqs)
        self.window = max(8, 2 * self.max_num_seqs)
        self.pending: dict[str, _Pending] = {}  # rows prepared or in the engine, by id
        # prepared, not yet in the engine: (id, prompt ids, tokens saved by the last checkpoint by sample)
        self.ready: deque[tuple[str, list[int], dict[int, list[int]]]] = deque()
        self.stats = RunStats(self.max_num_seqs, engine.stats)
        self.stop_signal: int | None = None
        # --id-column: ids checked job-wide, through an on-disk index (derived ids are unique by construction)
        self.ids = IdIndex(self.state.work / "ids.sqlite") if self.spec.id_column is not None else None
        self.names = {s.base >> ORDINAL_BITS: s.name for s in prep.sources}
        self._texts: dict[int, str] = {}  # --logprobs: each token's text, decoded once
        # How many rows there are: all workers' (None until every input is counted), this worker's share.
        counts = prep.info.row_counts
        for source in prep.sources:
            if counts.get(source.base >> ORDINAL_BITS) is None:
                counts[source.base >> ORDINAL_BITS] = count_rows(source)
        self.stream_hint = None if None in counts.values() else sum(counts.values())  # type: ignore[arg-type]
        self.total_hint = prep.shard.share_of(counts)
        self.reader_done = False  # every row of this worker's share has been read
        self.errors_before = self.manifest.errors  # rows failed in earlier runs (--max-errors counts all)
        self.bar = Progress(self.total_hint, self.manifest.rows, self.manifest.errors, self.max_num_seqs)
        self.last_checkpoint = self.last_live = time.monotonic()

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT while the loop runs: checkpoint and stop after this step."""
        if self.stop_signal is not None:
            print("batchjob: second signal, still saving state...", file=sys.stderr)
        self.stop_signal = signum

    # -- committing -----------------------------------------------------------------------------------

    def _finish_row(
        self,
        row: Row,
        text: str | None,
        reason: str,
        n_prompt: int,
        n_gen: int,
        error: str | None,
    ) -> None:
        """Buffer the result of a row that has one (an error row, before any sample)."""
        sample = {
            "generated_text": text,
            "finish_reason": reason,
            "num_generated_tokens": n_gen,
            "error": error,
        }
        self._finish_samples(row, n_prompt, [sample | {"sample_index": 0}])

    def _finish_samples(self, row: Row, n_prompt: int, samples: list[dict[str, Any]]) -> None:
        """Buffer an input row's result rows, one per sample (``generated_text``, ``finish_reason``,
        ``num_generated_tokens``, ``error`` and the feature columns each), and count it: one input row, its
        prompt once, however many samples (--n) it has; an error in any sample makes it a failed row."""
        self.parts.add(row.ordinal, {"values": row.values, "num_prompt_tokens": n_prompt}, samples)
        failed = any(s["error"] is not None for s in samples)
        self.stats.row(n_prompt, sum(s["num_generated_tokens"] for s in samples), failed, len(samples))
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
        """Every unfinished row: those in the engine (a reasoning row's answer saved as its finished
        thinking: the answer is redone), then those restored by the last checkpoint and not yet re-added."""
        if self.task != "generate":
            return []  # a prefill-only request has no tokens of its own to save: a resume computes it again
        by_id: dict[str, InFlight] = {}
        for snap in self.engine.snapshot():
            row_id, k, prompt, output = snap.request_id, snap.sample_index, snap.prompt_ids, snap.output_ids
            if row_id in self.answer_of:
                row_id, k = self.answer_of[row_id]
                p = self.pending[row_id]
                prompt, output = p.prompt, p.thoughts[k].token_ids
            record = by_id.get(row_id) or by_id.setdefault(row_id, self._record(row_id, list(prompt)))
            # --n: finished samples that wait for their siblings are not saved: they are recomputed on
            # resume (same tokens, they are seeded)
            record.samples[k] = list(output)
        for row_id, ids, samples in self.ready:
            if samples:
                by_id[row_id] = self._record(row_id, ids, samples)
        return list(by_id.values())

    def _record(
        self, row_id: str, prompt: list[int], samples: dict[int, list[int]] | None = None
    ) -> InFlight:
        p = self.pending[row_id]
        params = p.params.to_dict() if self.spec.per_row_params else None
        return InFlight(p.row.ordinal, row_id, prompt, dict(samples or {}), params, p.params.n > 1)

    def write_stats(self) -> None:
        body = self.stats.to_json(self.engine.stats.as_dict())
        finished = len({r["ordinal"] for r in self.parts.buffer})
        body["live"] = {  # what `status` shows of a running job beyond its committed rows
            "updated": time.time(),
            "finished_uncommitted": finished,  # input rows finished, not yet in a committed part
            "in_engine": len(self.pending) - len(self.ready),  # input rows being generated
            "read_ahead": len(self.ready),  # input rows prepared, waiting for room in the engine
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

    # -- feeding the engine ---------------------------------------------------------------------------

    def _admit(self, row: Row, inflight: dict[int, InFlight]) -> None:
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
                    row,
                    None,
                    "error",
                    0,
                    0,
                    f"duplicate id {row_id!r}: first used by row {where}; ids must be unique",
                )
                return
        assert row_id not in self.pending, row_id
        inputs = None
        if self.task != "generate" and self.spec.format == "openai":  # /v1/embeddings request lines
            inputs, error = self._embedding_inputs(row)
            if inputs is None:
                self._finish_row(row, None, "error", 0, 0, error)
                return
            params, ids = self.params, inputs[0]
        else:
            params, ids, error = self._request(row)
        if ids is None or params is None:
            self._finish_row(row, None, "error", 0, 0, error)
            return
        pending = _Pending(row, row_id, len(ids), params)
        if self.task != "generate":
            if inputs is not None:
                pending.inputs, pending.num_prompt_tokens = inputs, sum(len(x) for x in inputs)
            if self.spec.score_column is not None:
                pending.continuation, error = self._continuation(row)
                if pending.continuation is None:
                    self._finish_row(row, None, "error", 0, 0, error)
                    return
                pending.num_prompt_tokens += len(pending.continuation)
            self.ready.append((row_id, ids, {}))
            self.pending[row_id] = pending
            return
        if self.tags is not None:
            pending.inside = self.tags.inside(ids)
            closed = not pending.inside and self.tags.closed(ids)  # the template turned thinking off
            if not closed and (params.constrained or self.spec.max_reasoning_tokens is not None):
                ids = ids if pending.inside else ids + list(self.tags.open_ids)
                pending.prompt, pending.answer_params = ids, params
                pending.params = params = self._thinking_params(params)
        saved = inflight.pop(row.ordinal, None)
        samples: dict[int, list[int]] = {}
        if (
            saved is not None
            and saved.several == (params.n > 1)
            and saved.matches(row_id, ids, params.to_dict())
        ):
            samples = saved.samples
        self.ready.append((row_id, ids, samples))
        self.pending[row_id] = pending

    def _embedding_inputs(self, row: Row) -> tuple[list[list[int]] | None, str | None]:
        """--task embed --format openai: the token ids of each of the request's inputs, or its error."""
        assert row.values is not None
        body = row.values.get("body")
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            self.models_seen.add(body["model"])
        where = f"{row.source} line {row.line}: " if row.line is not None else ""
        check = self.model_names if self.spec.check_model_name else None
        texts, error = parse_embeddings_request(row.values, check, self.width)
        if texts is None:
            return None, where + str(error)
        inputs = []
        for k, text in enumerate(texts):
            ids, error = self.builder.build_request({"prompt": text})
            if ids is None:
                return None, f"{where}body.input[{k}]: {error}"
            inputs.append(ids)
        return inputs, None

    def _continuation(self, row: Row) -> tuple[list[int] | None, str | None]:
        """--score-column: the scored text's token ids (as ``Engine.score`` tokenizes a continuation), or
        why the row has none."""
        assert row.values is not None
        col = self.spec.score_column
        value = row.values.get(col)
        where = f"{row.source} line {row.line}: " if row.line is not None else ""
        if value is None:
            return None, f"{where}score column {col!r} is null or missing"
        if not isinstance(value, str):
            return None, f"{where}score column {col!r} is not text (got {type(value).__name__})"
        ids = self.engine.tokenize(value, special_tokens=False) if value else []
        if not ids:
            return None, f"{where}score column {col!r} is empty: there is nothing to score"
        return list(ids), None

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
        if self.spec.admission in admission.SORTED:
            return self.spec.lookahead
        return max(0, self.window - self.engine.num_unfinished)

    def _feed(self) -> None:
        """Move prepared rows into the engine while it has room, in the order ``--admission`` asks for."""
        while self.ready and self.engine.num_unfinished < self.window:
            i = admission.next_index(self.spec.admission, [len(ids) for _, ids, _ in self.ready])
            row_id, ids, samples = self.ready[i]
            del self.ready[i]
            if self.task != "generate":
                p = self.pending[row_id]
                if p.inputs is not None:  # an embeddings request: a request per input
                    for k, input_ids in enumerate(p.inputs):
                        self.input_of[f"{row_id}\x1finput{k}"] = (row_id, k)
                        self.engine.add_request(f"{row_id}\x1finput{k}", input_ids)
                    continue
                kw: dict[str, Any] = {}
                if self.task == "score":
                    kw = {
                        "continuation_ids": p.continuation,
                        "token_logprobs": self.spec.logprobs is not None,
                    }
                self.engine.add_request(row_id, ids, **kw)
                continue
            params = self.pending[row_id].params
            if params.n > 1 and samples:  # --n, resumed: each sample from its saved tokens (or afresh)
                for k in range(params.n):
                    self.engine.add_request(row_id, ids, params, samples.get(k), sample_index=k)
            else:
                self.engine.add_request(row_id, ids, params, output_ids=samples.get(0))

    def _finished(self, out: RequestOutput) -> None:
        if self.task != "generate":
            self._finished_task(out)
            return
        if out.request_id in self.answer_of:  # a reasoning row's answer
            row_id, k = self.answer_of.pop(out.request_id)
            p = self.pending[row_id]
        else:
            row_id, k = out.request_id, out.sample_index
            p = self.pending[row_id]
            if p.answer_params is not None and out.finish_reason != "error":
                self._answer(p, k, out)  # the thinking is done: now the answer, after it
                return
        self.stats.request(out)
        p.samples[k] = out
        if len(p.samples) < p.params.n:
            return  # --n: the row is written once all its samples are done
        del self.pending[row_id]
        results = []
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
            results.append(
                {
                    "generated_text": text,
                    "finish_reason": out.finish_reason,
                    "num_generated_tokens": n_gen,
                    "error": error,
                    "reasoning": reasoning,
                }
                | feature_columns(out, (p.answer_params or p.params).logprobs, self._token_text)
            )
        self._finish_samples(p.row, p.num_prompt_tokens, results)

    def _finished_task(self, out: RequestOutput) -> None:
        """A prefill-only request finished: its row's result (an embeddings request's, once all its inputs
        are: a result row each, by ``sample_index``)."""
        row_id, k = self.input_of.pop(out.request_id, (out.request_id, 0))
        p = self.pending[row_id]
        self.stats.request(out)
        p.samples[k] = out
        if len(p.samples) < (len(p.inputs) if p.inputs is not None else 1):
            return
        del self.pending[row_id]
        results = []
        for k in sorted(p.samples):
            out = p.samples[k]
            error = out.error if out.finish_reason == "error" else None
            if out.finish_reason == "error" and error is None:
                error = "the engine could not run this request"
            if error is not None and p.inputs is not None:
                error = f"body.input[{k}]: {error}"
            result = {"finish_reason": out.finish_reason, "num_generated_tokens": 0, "error": error}
            results.append(
                result | {"sample_index": k} | (task_columns(self.task, out) if error is None else {})
            )
        self._finish_samples(p.row, p.num_prompt_tokens, results)

    def _answer(self, p: _Pending, k: int, thought: RequestOutput) -> None:
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
        """Run to the end of this worker's rows, or until a signal or --max-errors stops it."""
        try:
            reader = self._reader()
            inflight = self.state.load_inflight()  # the last checkpoint's unfinished rows, by ordinal
            while True:
                self._read(reader, inflight)
                self._feed()
                if self.engine.has_unfinished():
                    self._step()
                elif self.reader_done:
                    break
                if self.stop_signal is not None:
                    self.checkpoint()
                    return self._result("interrupted")
                self._check_errors()
                self._save_as_due()
            self._complete()
            return self._result("complete")
        finally:
            self._close()

    def _reader(self) -> Iterator[Row]:
        """This worker's rows not yet done, in input order (with --id-column, the rows it skips still
        record their ids, so a duplicate is found whichever worker holds its first use)."""
        skip, covered = self.prep.shard.filters(self.manifest.done)
        on_skipped = None
        if self.ids is not None:
            ids = self.ids
            seen_to = ids.seen_to

            def on_skipped(ordinal: int, value: Any) -> None:  # rows of other workers, or done already
                if ordinal >= seen_to and value is not None:
                    ids.first(str(value), ordinal)
                ids.seen(ordinal + 1)

        return iter_rows(
            self.prep.sources,
            skip=skip,
            covered=covered,
            on_skipped=on_skipped,
            id_column=self.spec.id_column,
        )

    def _read(self, reader: Iterator[Row], inflight: dict[int, InFlight]) -> None:
        """Read rows and prepare them until the read-ahead is full or the input ends (then the row counts
        are known: the progress gets its total)."""
        while not self.reader_done and len(self.ready) < self._read_ahead():
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
            else:
                self._admit(row, inflight)
                if self.ids is not None:
                    self.ids.seen(row.ordinal + 1)

    def _step(self) -> None:
        """One engine step; its finished requests become result rows."""
        for out in self.engine.step():
            self._finished(out)
        self.stats.step(self.engine.stats)
        self.bar.step(self.stats.generated_tokens)

    def _check_errors(self) -> None:
        """--max-errors: stop, with the state saved, once that many rows have failed (this run and before)."""
        max_errors = self.spec.max_errors
        failed = self.errors_before + self.stats.errors
        if max_errors is not None and failed >= max_errors:
            self.checkpoint()
            raise TooManyErrors(
                f"stopped after {failed} failed rows (--max-errors {max_errors}); state saved in "
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
            self.last_checkpoint = self.last_live = time.monotonic()

    def _complete(self) -> None:
        """Every row is done: commit the last part, mark the job complete, drop the in-flight checkpoint."""
        check_inputs_unchanged(self.prep)  # a job is complete only for the inputs it recorded
        self.commit()
        if self.ids is not None:
            self.ids.commit()
        self.prep.info.mark_complete()
        self.state.save_job(self.prep.info)
        self.state.clear_inflight()
        self.write_stats()

    def _close(self) -> None:
        """However the run ends: close the progress and the id index; say which body.model names were
        ignored."""
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


def think_tags(spec: JobSpec, tokenizer: Any) -> ReasoningTags | None:
    """The model's think tags (``--reasoning-tags``, else found in its tokenizer), or None; refuses
    --max-reasoning-tokens for a model without them."""
    given = parse_tags(spec.reasoning_tags) if spec.reasoning_tags else None
    tags = find_tags(tokenizer, given)
    if tags is None and spec.max_reasoning_tokens is not None:
        raise ConfigError(
            "--max-reasoning-tokens needs the model's think tags, and its tokenizer names none: give them "
            "with --reasoning-tags OPEN,CLOSE"
        )
    return tags


def part_writer(prep: Prepared, engine: JobEngine, tags: ReasoningTags | None) -> PartWriter:
    """The run's one part writer: the input's columns, the task's result columns, then the feature columns
    the job's options (and with ``tags``, the model's thinking) call for."""
    spec = prep.spec
    if spec.task == "generate":
        params = spec.sampling_params(prep.info.job_seed)
        extra = extra_fields(params, every=spec.per_row_params, reasoning=tags is not None)
    else:
        extra = task_extra(spec)
    return PartWriter(
        prep.out_dir, prep.info.schema, part_prefix(prep.shard), extra, result_fields(spec, engine)
    )


def row_request(
    spec: JobSpec, builder: PromptBuilder, base: SamplingParams, row: Row, model_names: set[str] | None = None
) -> tuple[SamplingParams | None, list[int] | None, str | None]:
    """A row's sampling parameters (``base`` and what the row brings) and prompt ids, or the reason it has
    none, naming the line and the field. ``model_names``: what ``body.model`` may say (--check-model-name).

    Whatever goes wrong with one row (a value the chat template or tokenizer chokes on, one nested too
    deeply for a parser, any exception of ours or a library's) is that row's error, never the job's stop."""
    assert row.values is not None
    try:
        return _row_request(spec, builder, base, row, model_names)
    except Exception as e:  # noqa: BLE001 - one row must not stop the job, whatever it raises
        where = f"{row.source} line {row.line}" if row.line is not None else f"{row.source} row {row.index}"
        what = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        return None, None, f"{where}: cannot build this row's request ({what})"[:2000]


def _row_request(
    spec: JobSpec, builder: PromptBuilder, base: SamplingParams, row: Row, model_names: set[str] | None
) -> tuple[SamplingParams | None, list[int] | None, str | None]:
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


def feature_columns(out: RequestOutput, top_k: int | None = None, token_text: Any = None) -> dict[str, Any]:
    """The feature columns of one engine output: ``choice_*`` as ``{label: value}`` (Arrow maps), ``logprobs``
    as a list of per-token structs (``top_k``: the request's K; ``token_text``: a token id's text)."""
    choice_lp, choice_p, logprobs = out.choice_logprobs, out.choice_probs, out.logprobs
    return {
        "sample_index": out.sample_index,
        "choice_logprobs": None if choice_lp is None else dict(choice_lp),
        "choice_probs": None if choice_p is None else dict(choice_p),
        "logprobs": None
        if logprobs is None
        else token_logprobs(logprobs, list(out.token_ids), top_k or 0, token_text or str),
    }


def token_logprobs(
    tops: list[list[tuple[int, float]]], token_ids: list[int], k: int, token_text: Any
) -> list[dict[str, Any]]:
    """The engine's per-token lists (the top ``k``, best first, then the sampled token's when it is not among
    them) as one struct per generated token: the sampled token, its log-prob, and the top ``k``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token_id), "token_id": token_id, "logprob": logprob}

    out = []
    for top, token_id in zip(tops, token_ids, strict=False):
        chosen = next((lp for t, lp in reversed(top) if t == token_id), float("nan"))
        out.append(entry(token_id, chosen) | {"top_logprobs": [entry(t, lp) for t, lp in top[:k]]})
    return out


def part_prefix(shard: Shard) -> str:
    """Part file names of one worker: ``part-000012.parquet``, or ``part-00003-of-00008-000012.parquet``."""
    return "part-" if shard.single else f"part-{shard.index:05d}-of-{shard.count:05d}-"
