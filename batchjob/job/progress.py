"""Progress of a run as users expect it: a tqdm bar on a terminal, a plain line now and then in a log.

On a terminal: one bar with rows done of total, rows/s, generated tokens/s, errors so far and the time left.
When stderr is not a terminal (a Slurm log, a pipe): the same facts as one plain line at most every 30 s
(``BATCHJOB_PROGRESS_SECONDS`` changes the interval), so a log shows the job moving without filling up.

The time left is withheld until it means something: rows finish only once their whole answer is decoded,
and the first steps also pay for warm-up (kernel compilation, CUDA graphs), so a rate taken from the start
is far too slow early on. The ETA uses the rate since the first row of this run finished, once ``warmup``
rows (a batch's worth) have finished; before that the line says what it waits for.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    def __init__(self, total: int | None, done: int, errors: int, warmup: int = 1) -> None:
        self.total = total
        self.warmup = max(2, warmup)  # rows of this run to finish before an ETA is given
        self.first: tuple[float, int] | None = None  # (when, rows done) at this run's first finished row
        self.done = done
        self.errors = errors
        self.start_done = done
        self.tokens = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.every = _seconds(os.environ.get("BATCHJOB_PROGRESS_SECONDS", "30"))
        self.last_line = self.start
        self.bar = (
            tqdm(total=total, initial=done, unit="row", dynamic_ncols=True, desc="batchjob")
            if self.tty
            else None
        )

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self.bar is not None and total is not None:
            self.bar.total = total

    def row(self, error: bool) -> None:
        if self.first is None:
            self.first = (time.monotonic(), self.done)
        self.done += 1
        self.errors += int(error)
        if self.bar is not None:
            self.bar.update(1)

    def step(self, generated_tokens: int) -> None:
        """After an engine step; ``generated_tokens``: this run's so far."""
        self.tokens = generated_tokens
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{generated_tokens / elapsed:.1f} tok/s, {self.errors} errors", refresh=False
            )
        elif now - self.last_line >= self.every:
            self.last_line = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        total = f" of {self.total:,}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        eta = ""
        if self.total is not None:
            eta = f", ETA {self.eta()}"
        return (
            f"batchjob: {self.done:,}{total} rows{pct}, {rate:.2f} rows/s, {self.tokens / elapsed:.1f} tok/s, "
            f"{self.errors} errors{eta}"
        )

    def eta(self) -> str:
        """The time left at the rate since this run's first finished row, or what it waits for."""
        assert self.total is not None
        if self.done >= self.total:
            return _duration(0)
        warmup = min(self.warmup, max(2, (self.total - self.start_done) // 10))
        ran = self.done - self.start_done
        if self.first is None or ran < warmup:
            return f"after the first {warmup:,} rows"
        since, rows_then = self.first
        rate = (self.done - rows_then - 1) / max(time.monotonic() - since, 1e-9)
        if rate <= 0:
            return f"after the first {warmup:,} rows"
        return _duration(max(0, self.total - self.done) / rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _seconds(value: str) -> float:
    """``BATCHJOB_PROGRESS_SECONDS``: a number of seconds; anything else is the default's 30 (a log line's
    interval is not worth stopping a job for), said once."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        print(
            f"batchjob: BATCHJOB_PROGRESS_SECONDS={value!r} is not a number of seconds: 30 s", file=sys.stderr
        )
        return 30.0
    return seconds
