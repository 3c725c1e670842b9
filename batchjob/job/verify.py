"""Committed parts checked against the manifest, and rows taken back to be redone (damaged parts, error rows).

The manifest says which rows are done; a part file can still be deleted, truncated or changed behind its
back. So at every start (and in ``status``, ``export``, ``report``: one verdict, ``check_part``) each listed
part must exist, have the byte size recorded when it was committed, a Parquet footer holding the recorded
number of result rows, and, when its inode or status-change time differs from the recorded ones (something
wrote to it, or the folder was copied), the recorded SHA-256 of its content. An untouched part costs a
``stat`` and a footer read, never a read of every byte; a part changed through the file system in any way
is read whole and caught. Records written before these fields existed are checked as far as they go.

``batchjob run`` then takes back what it cannot trust: a missing or damaged part is dropped from the manifest
and deleted, so its rows are no longer done and the loop computes them again. With ``--retry-errors``, each
part holding error rows is rewritten without them (an ordinal with an error in any of its samples is taken
back whole), and those rows are computed again too.

Order, so that a crash at any point leaves a state the next start repairs:

1. rewritten parts are written under new names, atomically, one at a time (until the manifest names them
   they are orphans: a crash leaves them for the next start to delete, and the job as it was);
2. a job marked complete is marked incomplete (a crash after 3 must not leave "complete" over rows that are
   no longer listed);
3. the manifest is rewritten atomically without the dropped records, and with the rewritten ones;
4. the dropped and replaced files are deleted (a crash before this leaves them as orphans, deleted likewise).

``BATCHJOB_FAULT_KILL=after_part_rewrite`` (after 2) or ``after_manifest_rewrite`` (after 3) kills the
process there, for the crash tests (``batchjob.faults``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjob import faults
from batchjob.errors import StateError
from batchjob.io.writers import PartWriter, file_sha256
from batchjob.job.inputs import split_ordinal
from batchjob.job.intervals import IntervalSet
from batchjob.job.manifest import Manifest, PartRecord
from batchjob.job.state import JobInfo, JobMismatchError, StateDir


@dataclass
class PartProblem:
    record: PartRecord
    reason: str  # "is missing", "has 812 bytes, 1633 recorded", ...

    def __str__(self) -> str:
        return f"{self.record.name} {self.reason}"


def check_part(out_dir: Path, record: PartRecord) -> str | None:
    """What is wrong with a committed part's file, or None when it is as recorded: the one verdict on a
    part that ``run``, ``status``, ``export`` and ``report`` all take.

    Size and footer always; the content (its SHA-256) when the file's inode or status-change time is not
    what was recorded at commit, that is when anything may have written to it since (a write, even one
    that keeps the size and time stamp, moves the status-change time; a copy of the folder has new inodes).
    """
    path = out_dir / record.name
    try:
        st = path.stat()
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if record.size is not None and st.st_size != record.size:
        return f"has {st.st_size} bytes, {record.size} recorded"
    try:
        rows = pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException) as e:
        return f"has an unreadable Parquet footer ({e})"
    if record.result_rows is not None and rows != record.result_rows:
        return f"holds {rows} rows, {record.result_rows} recorded"
    if record.sha256 is not None and (st.st_ino, st.st_ctime_ns) != (record.ino, record.ctime_ns):
        try:
            digest = file_sha256(path)
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if digest != record.sha256:
            return "is damaged (its content differs from what was committed: checksum mismatch)"
    return None


# What to do about missing or damaged parts, the same words from every command.
REDO = "`batchjob run` with the same command deletes them and redoes their rows (the rest is kept)"


class DamagedPartError(StateError):
    """A committed part that can't be read, found while reading it (``export``, ``report``)."""

    def __init__(self, out_dir: Path, name: str, reason: str) -> None:
        super().__init__(
            f"{out_dir}: part {name} {reason}; delete it, then run the job again with the same `batchjob run` "
            "command: its rows are redone (the rest is kept)"
        )


def read_batches(out_dir: Path, name: str, **options: Any) -> Iterator[pa.RecordBatch]:
    """The record batches of a committed part; a part that fails while being read raises DamagedPartError
    naming it (what ``check_part`` can't see without reading every byte of a part it has no digest of)."""
    try:
        yield from pq.ParquetFile(out_dir / name).iter_batches(**options)
    except (OSError, pa.ArrowException) as e:
        raise DamagedPartError(out_dir, name, f"cannot be read ({e})") from e


def check_parts(out_dir: Path, manifest: Manifest) -> list[PartProblem]:
    """The manifest's parts that are missing or do not match their records."""
    problems = []
    for record in manifest.parts:
        reason = check_part(out_dir, record)
        if reason is not None:
            problems.append(PartProblem(record, reason))
    return problems


def check_schema(out_dir: Path, manifest: Manifest, fields: tuple[pa.Field, ...]) -> None:
    """Refuse to add parts whose result columns differ in type from the committed ones (a job started by an
    earlier batchjob, e.g. ``choice_probs`` as JSON text where this one writes a map): one job, one schema.
    ``fields``: every feature column this version may write; the first readable committed part is read."""
    for record in manifest.parts:
        try:
            schema = pq.read_schema(out_dir / record.name)
        except (OSError, pa.ArrowException):
            continue  # missing or damaged: repaired (redone) like any other
        changed = [
            f"{f.name} is {schema.field(f.name).type} there, {f.type} now"
            for f in fields
            if f.name in schema.names and schema.field(f.name).type != f.type
        ]
        if changed:
            raise JobMismatchError(
                f"--output {out_dir}: its parts were written by an earlier batchjob with other column types "
                f"({'; '.join(changed)}, e.g. in {record.name}); one job's parts share one schema, so this "
                "version will not add to it. Finish the job with the version that started it, or run it "
                "into a new --output folder (`batchjob export` reads this one as it is)"
            )
        return


def restamp(out_dir: Path, manifest: Manifest) -> int:
    """Record the inode and status-change time of parts whose content still is as committed but whose
    stamps moved (a copied or restored output folder, a ``chmod``), so that later checks need not read them
    whole again. Needs the job's lock; returns how many records changed."""
    records, changed = [], 0
    for record in manifest.parts:
        path = out_dir / record.name
        try:
            st = path.stat()
            moved = record.sha256 is not None and (st.st_ino, st.st_ctime_ns) != (record.ino, record.ctime_ns)
            if moved and st.st_size == record.size and file_sha256(path) == record.sha256:
                # stamps taken before reading: a write since then moves them again, and is caught next time
                record = replace(record, ino=st.st_ino, ctime_ns=st.st_ctime_ns)
                changed += 1
        except OSError:
            pass  # check_part's business
        records.append(record)
    if changed:
        manifest.rewrite(records)
    return changed


def needs_repair(out_dir: Path, manifest: Manifest, retry_errors: bool) -> bool:
    """Whether ``repair_outputs`` would take rows back (cheap: sizes and footers, and the content only of
    parts whose stamps moved)."""
    return (retry_errors and manifest.errors > 0) or bool(check_parts(out_dir, manifest))


def _row_ordinals(table: pa.Table, record: PartRecord, per_sample: bool) -> list[int] | None:
    """The input-row ordinal of each result row, or None when the part does not match its record.

    Rows are sorted by (ordinal, sample_index) and the record lists the ordinals, so result rows map onto
    them in order; a row's first result row is its sample 0 (with ``--n``, an error row has only that one).
    """
    ordinals = [o for a, b in record.ordinals for o in range(a, b)]
    if per_sample:
        starts = [not s for s in table.column("sample_index").to_pylist()]
    else:
        starts = [True] * table.num_rows
    if sum(starts) != len(ordinals) or (starts and not starts[0]):
        return None
    out, i = [], -1
    for start in starts:
        i += start
        out.append(ordinals[i])
    return out


def _without(
    out_dir: Path, record: PartRecord, writer: PartWriter, retry_errors: bool, redo: set[int]
) -> tuple[pa.Table, PartRecord | None, int] | str:
    """A part's table without the rows of the ordinals to take back (those in ``redo``, and with
    ``retry_errors`` those with an error), its record (None when nothing is left) and how many input rows
    were taken out; or what is wrong with the part."""
    per_sample = any(f.name == "sample_index" for f in writer.extra)
    try:
        table = pq.read_table(out_dir / record.name).cast(writer.schema)
    except (OSError, ValueError, pa.ArrowException) as e:
        return f"cannot be read back ({e})"
    ordinals = _row_ordinals(table, record, per_sample)
    if ordinals is None:
        return "does not match its record's rows"
    errors = table.column("error").to_pylist()
    bad = {o for o, e in zip(ordinals, errors, strict=True) if o in redo or (retry_errors and e is not None)}
    keep = [o not in bad for o in ordinals]
    kept = table.filter(pa.array(keep, type=pa.bool_()))
    if kept.num_rows == 0:
        return kept, None, len(bad)
    done = IntervalSet()
    for o, k in zip(ordinals, keep, strict=True):
        if k:
            done.add(o)

    def total(column: str) -> int:
        if column not in kept.column_names:  # a prefill-only task's parts: nothing generated
            return 0
        return int(pc.sum(kept.column(column)).as_py() or 0)

    new = PartRecord(
        name="",
        rows=len(done),
        errors=sum(e is not None for e, k in zip(errors, keep, strict=True) if k),
        prompt_tokens=(  # each input row's prompt once, not once a sample
            int(
                pc.sum(
                    kept.filter(pc.equal(kept.column("sample_index"), 0)).column("num_prompt_tokens")
                ).as_py()
                or 0
            )
            if "sample_index" in kept.column_names
            else total("num_prompt_tokens")
        ),
        generated_tokens=total("num_generated_tokens"),
        ordinals=done.ranges(),
        unread=[o for o in record.unread if o in done],
    )
    return kept, new, len(bad)


def _repair_part(
    record: PartRecord,
    writer: PartWriter,
    names: set[str],
    retry_errors: bool,
    redo: set[int],
    redo_reason: str,
) -> tuple[str | None, int, PartRecord | None]:
    """``(note, rows taken back, rewrite)`` for one intact part: no note when none of its rows is redone;
    no rewrite when the whole part goes (unreadable, or every row taken back), else the record of its
    rewrite without those rows, written now under a new name (added to ``names``)."""
    redone = {o for o in redo if any(a <= o < b for a, b in record.ordinals)}
    if not redone and not (retry_errors and record.errors):
        return None, 0, None
    result = _without(writer.out_dir, record, writer, retry_errors, redone)
    if isinstance(result, str):
        return f"{record.name} {result}: its {record.rows} rows will be redone", record.rows, None
    table, new, taken = result
    if taken == 0:
        return None, 0, None  # counted as errors but none in the file: nothing to redo
    if redone:
        note = f"{record.name}: {taken} rows will be redone ({redo_reason})"
    else:
        note = f"--retry-errors: {record.name} holds {taken} rows with errors; they will be redone"
    if new is None:
        return note, taken, None
    # written now (one part in memory at a time); until the manifest names it, it is an orphan
    name = writer.write_table(writer.next_seq(names), table)
    names.add(name)
    return note, taken, replace(new, name=name, result_rows=table.num_rows, **writer.stamp(name))


def _forget_counts(info: JobInfo, unread: set[int]) -> bool:
    """Forget the row count of each file whose unreadable-rest row (``unread``: their ordinals) is taken back;
    whether any was. The reader counted such a file up to where its read failed (30 of its 40 rows); the
    rerun reads on past there, and status said 'rows: 33 of 30 input rows'. Until the reader reaches the
    file's end again, its length is unknown."""
    files = {split_ordinal(o)[0] for o in unread}
    for record in info.inputs:
        if record.seq in files:
            record.rows = None
    return bool(files)


def repair_outputs(
    state: StateDir,
    info: JobInfo,
    manifest: Manifest,
    writer: PartWriter,
    retry_errors: bool = False,
    redo: set[int] = frozenset(),  # type: ignore[assignment]
    redo_reason: str = "their input rows changed",
) -> int:
    """Take back the rows of missing or damaged parts (and, with ``retry_errors``, the rows with errors, and
    the rows of the ordinals in ``redo``), so that the job loop computes them again. Prints a line per part;
    returns how many input rows are redone.

    Needs the job's lock. ``info`` is marked incomplete (and saved) when anything is taken back, and a file
    whose unreadable-rest row is taken back loses its row count (``_forget_counts``).
    """
    out_dir = writer.out_dir
    problems = check_parts(out_dir, manifest)
    dropped = {p.record.name for p in problems}  # old names whose rows are all redone
    notes = [f"{p}: its {p.record.rows} rows will be redone" for p in problems]
    count = sum(p.record.rows for p in problems)
    names = set(manifest.names)  # taken, with the new parts written below
    written: dict[str, PartRecord] = {}  # old name -> its rewrite without the error rows, already on disk
    for record in manifest.parts:
        if record.name in dropped:
            continue
        note, taken, rewrite = _repair_part(record, writer, names, retry_errors, redo, redo_reason)
        if note is None:
            continue
        notes.append(note)
        count += taken
        if rewrite is None:
            dropped.add(record.name)
        else:
            written[record.name] = rewrite
    if not dropped and not written:
        restamp(out_dir, manifest)
        return 0
    for note in notes:
        print(f"batchjob: {note}", file=sys.stderr)
    kept = [written.get(r.name, r) for r in manifest.parts if r.name not in dropped]
    forgot = _forget_counts(info, manifest.unread - {o for r in kept for o in r.unread})
    if info.complete or forgot:  # before the manifest: after a crash between, no 'complete' and no count
        # outlives the rows it was for
        info.complete_for = None
        state.save_job(info)
    faults.die("after_part_rewrite")
    manifest.rewrite(kept)
    faults.die("after_manifest_rewrite")
    for name in dropped | set(written):
        (out_dir / name).unlink(missing_ok=True)
    return count
