"""The order rows enter the engine (``--admission``), in one place for the job loop and the benchmarks.

``fcfs``: input order. ``longest-first`` / ``shortest-first``: the longest (shortest) of the rows waiting in
the lookahead window, ties in input order. ``static``: input order, in static batches (the engine's
``static_batching`` does the batching). Inside the engine the scheduler keeps its own order among the
requests it was given (``engine/scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

ADMISSION_CHOICES = ("fcfs", "longest-first", "shortest-first", "static")
SORTED = ("longest-first", "shortest-first")  # the policies that choose among a lookahead window


def next_index(policy: str, lengths: Sequence[int]) -> int:
    """Which of the waiting rows (their lengths, in input order) enters next."""
    if policy == "longest-first":
        return max(range(len(lengths)), key=lengths.__getitem__)
    if policy == "shortest-first":
        return min(range(len(lengths)), key=lengths.__getitem__)
    return 0


def order(policy: str, lengths: Sequence[int]) -> list[int]:
    """The whole admission order of rows whose lengths are all known at once: ``next_index`` repeated."""
    if policy == "longest-first":
        return sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if policy == "shortest-first":
        return sorted(range(len(lengths)), key=lambda i: lengths[i])
    return list(range(len(lengths)))
