"""The rows read ahead of admission, in input order; an image job's are built on worker threads.

The loop reads each row on its own thread, in input order, and checks its id there (the id index sees rows
in stream order); the row then waits here until it is built. An image row's build (its images read and
decoded by Pillow, the processor's resize, normalise, chat template and tokens: ``RowMaker.image_prompt``)
runs on one of ``--image-workers`` threads, each with its own copy of the processor; Pillow's decoders and
resampling, numpy and the tokenizer let go of the GIL for their heavy parts. The loop admits the same rows at
the same moments as it would building each row itself (``--image-workers 0``, and every text job: no pool),
taking each back in input order and waiting for its build if need be: so the engine's batches, and with them
every bit of the results (log-probabilities too), ids, error rows and checkpoints, do not depend on the
threads. What the workers gain is building those rows at once, and building the next ones (``depth``: two a
worker) while the engine steps. A row's failure is its build's result, an error row; an exception (a file
that changed since the job recorded it) is raised when that row's turn comes, as it would have been then.
A row read ahead at a checkpoint is not in it: like a row not yet read, it is computed again after a kill.

Memory: the read-ahead's rows (``JobLoop._read_ahead``), and at most ``depth`` rows beyond them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from batchjob.io.fits import column_type, id_text
from batchjob.io.readers import Row, iter_rows
from batchjob.io.sources import ORDINAL_BITS, Source

if TYPE_CHECKING:
    from batchjob.job.ids import IdIndex
    from batchjob.job.intervals import IntervalSet
    from batchjob.job.prepare import Prepared
    from batchjob.job.rows import Built, RowMaker


def read_rows(prep: Prepared, done: IntervalSet, unread: set[int], ids: IdIndex | None) -> Iterator[Row]:
    """This worker's rows not yet ``done``, in input order (with --id-column, the rows it skips still
    record their ids in ``ids``, so a duplicate is found whichever worker holds its first use). ``unread``:
    the done rows that were their file's unreadable rest."""
    skip, covered = prep.shard.filters(done)

    def read_past(source: Source, index: int) -> bool:  # did an earlier run read the file past row index?
        ordinal = source.base + index
        if ordinal in done and ordinal not in unread:  # it read that row
            return True
        return done.meets(ordinal + 1, source.base + (1 << ORDINAL_BITS))  # or rows after it

    on_skipped = None
    if ids is not None:
        index, seen_to = ids, ids.seen_to
        id_type = column_type(prep.info.schema, prep.spec.id_column)

        def on_skipped(ordinal: int, value: Any) -> None:  # rows of other workers, or done already
            if ordinal >= seen_to and value is not None:
                index.first(id_text(value, id_type), ordinal)
            index.seen(ordinal + 1)

    return iter_rows(
        prep.sources,
        skip=skip,
        covered=covered,
        on_skipped=on_skipped,
        id_column=prep.spec.id_column,
        schema=prep.info.schema,
        stop_unread=not prep.shard.single,  # a file's unread rest may hold this worker's rows: stop, say so
        read_past=read_past,  # a resumed job whose file can't be read where it was read before: stop too
    )


def default_workers() -> int:
    """``--image-workers``' default: one a CPU this process may use, at most 4."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, cpus)


class Taken(NamedTuple):
    """A row given back to the loop: its id or why it has none, and its build (None: the loop builds it)."""

    row: Row
    row_id: str | None
    error: str | None
    built: Built | None


@dataclass
class _Read:
    """A row read, with its id or why it has none, and its build when a worker makes it."""

    row: Row
    row_id: str | None
    error: str | None
    built: Future[Built] | None = None


class Ahead:
    """The rows read and not yet admitted, in input order (``len``: how many); ``workers`` threads build an
    image job's rows (None: ``default_workers``; 0, or a job without images: none, the loop builds each
    row as it admits it)."""

    def __init__(self, rows: RowMaker, workers: int | None) -> None:
        self.read: deque[_Read] = deque()
        self.pool: ThreadPoolExecutor | None = None
        self.depth = 0  # rows to read beyond what the loop admits (0: none, each is read when admitted)
        images = rows.images
        workers = default_workers() if workers is None else workers
        if images is None or workers == 0:
            return
        try:
            copies = [images.copy() for _ in range(workers)]
        except Exception as e:  # noqa: BLE001 - a processor that can't be copied is used on one thread
            print(
                f"batchjob: --image-workers: the processor can't be copied ({type(e).__name__}: {e}); image "
                "rows are built on the job's main thread",
                file=sys.stderr,
            )
            return
        local = threading.local()

        def start() -> None:  # a worker's first task: its own copy of the processor
            local.images = copies.pop()

        def build(row: Row) -> Built:
            return rows.image_prompt(row, local.images)

        self.build = build
        self.pool = ThreadPoolExecutor(workers, "batchjob-images", initializer=start)
        self.depth = 2 * workers  # a row building on each worker and one waiting for it

    def __len__(self) -> int:
        return len(self.read)

    def add(self, row: Row, row_id: str | None, error: str | None) -> None:
        """A row read (its id checked): built on a worker from now, unless it has no id (an error row)."""
        built = self.pool.submit(self.build, row) if self.pool is not None and row_id is not None else None
        self.read.append(_Read(row, row_id, error, built))

    def pop(self) -> Taken:
        """The first row, waiting for its build if it is not done."""
        first = self.read.popleft()
        built = None if first.built is None else first.built.result()  # (raises what the build raised)
        return Taken(first.row, first.row_id, first.error, built)

    def close(self) -> None:
        """However the run ends: the builds not started are dropped, those running end on their own."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
