"""Jobs: a spec, its prompts, its state on disk, and the loop that runs it over an engine."""

from batchjob.job.runner import EXIT_INTERRUPTED, JobResult, TooManyErrors, prepare, run_job
from batchjob.job.spec import JobSpec, load_job_file, make_spec

__all__ = [
    "EXIT_INTERRUPTED",
    "JobResult",
    "JobSpec",
    "TooManyErrors",
    "load_job_file",
    "make_spec",
    "prepare",
    "run_job",
]
