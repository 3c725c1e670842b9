"""``batchjob bench``: one workload through our engine and the alternatives a user already has, side by side.

The alternatives are transformers' own continuous batching (a ``ContinuousBatchingManager``, one per token
budget tried) and plain ``model.generate`` on left-padded static batches. Every engine gets the very same
token-id prompts and the same per-request ``max_new_tokens``, greedy, EOS ignored, so each does the same work;
each is warmed up first and timed alone, in this one process. The report gives output and total tokens/s,
the ratios ours/theirs, where our wall time goes (model forward vs everything else), and how many of our
greedy outputs equal the baselines' token for token (a sanity column: fp32 rounding may flip a few).

This package knows workloads and timing; it drives the engine through its public API only.
"""

from batchjob.bench.command import bench

__all__ = ["bench"]
from batchjob.bench import scheduling as _scheduling  # noqa: E402,F401  (registers "batchjob bench-scheduling")
