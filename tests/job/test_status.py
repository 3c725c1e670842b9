"""``batchjob status``: what it says of a job's progress, read from the output folder alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchjob.job.shard import Shard
from batchjob.job.status import JobStatus, WorkerStatus

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("done", "total", "shown"),
    [
        (1999, 2000, "99.9%"),
        (19_999, 20_000, "99.9%"),
        (2000, 2000, "100.0%"),
        (1, 3, "33.3%"),
        (2, 3, "66.6%"),
    ],
)
def test_the_share_done_is_floored_so_an_incomplete_job_is_never_at_100_percent(done, total, shown):
    """1999 of 2000 rows showed '(100.0%)', rounded up: the share is floored to a tenth now."""
    status = JobStatus(Path("out"), [WorkerStatus(Shard(0, 1), "stopped", rows_done=done)], total)
    assert f"rows: {done} of {total} input rows ({shown})" in status.lines("out")
