"""The last check before a run says complete: its inputs are still the files the job recorded.

The reader checks each file while it reads it (``batchjob.io.watch``); this catches what it can't see: a
file changed after the job recorded it but before the reader opened it, or after the reader was done with
it while the engine still worked on its rows. A job is only complete for the inputs it recorded.
"""

from __future__ import annotations

from batchjob.job.inputs import InputChangedError, reconcile
from batchjob.job.prepare import Prepared


def check_inputs_unchanged(prep: Prepared) -> None:
    """Raise InputChangedError (exit 2), naming each file and what changed, when an input is not as the job
    recorded it; the rows committed so far are kept."""
    try:
        reconcile(prep.info.inputs, prep.sources, False, prep.out_dir)
    except InputChangedError as e:
        raise InputChangedError(
            f"the job stopped before saying complete (the rows it committed are kept): {e}", e.problems
        ) from None
