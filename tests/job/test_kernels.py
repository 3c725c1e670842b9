"""The kernels a job records (``job/kernels.py``): a resume under others is refused by name; a job recorded
before its kind had the entry is not asked for it."""

from __future__ import annotations

from batchjob.job.kernels import kernel_changes


def test_a_job_recorded_before_the_entry_is_not_asked_for_it():
    """A generation job an earlier batchjob started with --tensor-parallel-size 2 recorded no kernels: refusing
    its resume with the same option (as a change from the defaults) would leave it no way to go on."""
    old = {"model": {}, "prompt": {}}
    now = {"model": {}, "prompt": {}, "kernels": {"tensor_parallel_size": 2}}
    assert kernel_changes(old, now) == []
    assert kernel_changes({**old, "kernels": {}}, now) == ["kernels.tensor_parallel_size: was None, now 2"]
    off = {**old, "kernels": {"BATCHJOB_CPU_KERNEL": "off"}}
    assert kernel_changes(off, {**old, "kernels": {}}) == [
        "kernels.BATCHJOB_CPU_KERNEL: was off, now on (it changes float rounding: set BATCHJOB_CPU_KERNEL=0 in "
        "the environment to resume)"
    ]
