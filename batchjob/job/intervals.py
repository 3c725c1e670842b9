"""A set of non-negative integers stored as sorted, merged half-open ranges.

Rows finish nearly in input order, so the set of finished row ordinals of a million-row job is a handful of
ranges: this is what lets a resumed job skip what is done without holding an id per row.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class IntervalSet:
    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for a, b in ranges:
            self.add_range(a, b)

    def add(self, x: int) -> None:
        self.add_range(x, x + 1)

    def add_range(self, a: int, b: int) -> None:
        if b <= a:
            return
        # ranges touching or overlapping [a, b) merge into one
        lo = bisect.bisect_left(self._ends, a)
        hi = bisect.bisect_right(self._starts, b)
        if lo < hi:
            a = min(a, self._starts[lo])
            b = max(b, self._ends[hi - 1])
        self._starts[lo:hi] = [a]
        self._ends[lo:hi] = [b]

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._ends[i]

    def covers(self, a: int, b: int) -> bool:
        """Whether every integer of ``[a, b)`` is in the set."""
        if b <= a:
            return True
        i = bisect.bisect_right(self._starts, a) - 1
        return i >= 0 and b <= self._ends[i]

    def meets(self, a: int, b: int) -> bool:
        """Whether any integer of ``[a, b)`` is in the set."""
        i = bisect.bisect_right(self._ends, a)  # the first range ending past a
        return i < len(self._starts) and self._starts[i] < b

    def __len__(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._ends, strict=True))

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self._starts, self._ends, strict=True)]

    def update(self, other: IntervalSet) -> None:
        for a, b in other.ranges():
            self.add_range(a, b)
