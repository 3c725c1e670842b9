"""The last check before a run says complete: its inputs are still the files the job recorded, and its
--input folders and globs match no file it did not record.

The reader checks each file while it reads it (``batchjob.io.watch``); this catches what it can't see: a
file changed after the job recorded it but before the reader opened it, or after the reader was done with
it while the engine still worked on its rows, and a file added under a folder or glob while the job ran
(found by the discovery the start used, as a rerun finds it). A job is only complete for its inputs as they
are.
"""

from __future__ import annotations

from batchjob.errors import BatchjobError
from batchjob.io.sources import discover
from batchjob.job.inputs import InputChangedError, named_as_recorded, reconcile
from batchjob.job.prepare import Prepared


def check_inputs_unchanged(prep: Prepared) -> None:
    """Raise InputChangedError (exit 2), naming each file and what changed (a new one: to run with
    --append), when an input is not as the job recorded it; the rows committed so far are kept."""
    try:
        found = named_as_recorded(prep.info.inputs, discover(prep.spec.input, exclude=prep.out_dir))
    except BatchjobError:  # an --input gone altogether: its recorded files are named as removed below
        found = prep.sources
    try:
        reconcile(prep.info.inputs, found, False, prep.out_dir)
    except InputChangedError as e:
        raise InputChangedError(
            f"the job stopped before saying complete (the rows it committed are kept): {e}", e.problems
        ) from None
