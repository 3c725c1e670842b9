"""The settings that change the last bits of a job's floats, not what it computes: the attention backend,
compiled kernels, a split across ranks, and the CPU fast paths' switches that round otherwise.

A job records them (its ``kernels`` entry: a task job's in its ``task`` entry, where it was first kept; a
generation job's at the top; a job recorded before its kind had the entry is not asked for it) and a resume
under others is refused by name: its rows would be written rounded two ways, beside each other, without a word (an embed job
resumed with ``BATCHJOB_CPU_PREFILL=0``: 292 of 400 embeddings differed from an uninterrupted run's).

Not recorded: the CPU's own instructions (a bf16 job resumed on a CPU without AVX512-BF16 takes other
kernels) and the thread count; ``docs/jobs.md`` says so.
"""

from __future__ import annotations

from typing import Any

from batchjob import env
from batchjob.engine.options import EngineOptions

# The switches that change float rounding (measured on an AVX512-BF16 CPU without AMX): the decode and prompt
# attention kernels, our bf16 linear kernel (~20 outputs in a million differ from oneDNN's), and packed
# weights (oneDNN's float32 products are not MKL's). BATCHJOB_CPU_JOINT (q, k and v in one GEMM: bit for bit
# the same columns), _ROWS (bit for bit torch's norms), _HEAP and _SPIN_GUARD (no arithmetic) are not.
ROUNDING_FLAGS = (
    "BATCHJOB_CPU_KERNEL",
    "BATCHJOB_CPU_PREFILL",
    "BATCHJOB_CPU_LINEAR",
    "BATCHJOB_CPU_PREPACK",
)
_DEFAULTS: dict[str, Any] = {"attention_backend": "auto", "compile": False, "tensor_parallel_size": 1}


def kernels_entry(options: EngineOptions) -> dict[str, Any]:
    """The job's kernels, each named only where not the default (None: the engine decides, the default)."""
    given = {name: getattr(options, name) for name in _DEFAULTS}
    # each against its own default: against one tuple of them, True == 1 left --compile out
    out = {k: v for k, v in given.items() if v is not None and v != _DEFAULTS[k]}
    for name in ROUNDING_FLAGS:
        if not env.flag(name):
            out[name] = "off"
    return out


def generation_kernels(options: EngineOptions) -> dict[str, Any]:
    """A generation job's ``kernels`` entry, empty where all are the defaults (a task job's is in its task
    entry). It is there, if empty, so that a job recorded before it is told apart (``recorded``)."""
    return {"kernels": kernels_entry(options)} if options.task == "generate" else {}


def recorded(fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """A fingerprint's kernels entry; None where the job was recorded before its kind had one: such a job is
    not told apart by them, nor asked for them again (a generation job started with --tensor-parallel-size 2
    by an earlier batchjob resumes with it, as before, where refusing would leave it no way to go on)."""
    if "task" in fingerprint:
        return fingerprint["task"].get("kernels")
    return fingerprint.get("kernels")


def without(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint without its kernels entry (``kernel_changes`` compares those)."""
    out = {k: v for k, v in fingerprint.items() if k != "kernels"}
    if "task" in out:
        out["task"] = {k: v for k, v in out["task"].items() if k != "kernels"}
    return out


def kernel_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints' kernels, in words; an environment switch says how to set it
    back (an option is given again as the job was started, as any other)."""
    was, is_ = recorded(saved), recorded(now)
    if was is None or is_ is None:
        return []
    where = "task.kernels" if "task" in now else "kernels"
    out = []
    for key in sorted(set(was) | set(is_)):
        if was.get(key) == is_.get(key):
            continue
        if key in ROUNDING_FLAGS:
            before = "off" if key in was else "on"
            back = f"set {key}=0" if key in was else f"unset {key}"
            out.append(
                f"{where}.{key}: was {before}, now {'off' if key in is_ else 'on'} (it changes float rounding: "
                f"{back} in the environment to resume)"
            )
        else:
            out.append(f"{where}.{key}: was {was.get(key)!r}, now {is_.get(key)!r}")
    return out
