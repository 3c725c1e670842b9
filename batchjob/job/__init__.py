"""Jobs: a spec, its prompts, its state on disk, and the loop that runs it over an engine."""

from batchjob.job.loop import EXIT_INTERRUPTED, JobResult, TooManyErrors
from batchjob.job.prepare import prepare
from batchjob.job.runner import run_job
from batchjob.job.shard import Shard, detect_shard
from batchjob.job.spec import JobSpec, load_job_file, make_spec
from batchjob.job.status import JobStatus, job_status

__all__ = [
    "EXIT_INTERRUPTED",
    "JobResult",
    "JobSpec",
    "JobStatus",
    "Shard",
    "TooManyErrors",
    "detect_shard",
    "job_status",
    "load_job_file",
    "make_spec",
    "prepare",
    "run_job",
]
