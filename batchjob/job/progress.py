"""Progress of a run as users expect it: a tqdm bar on a terminal, a plain line now and then in a log.

On a terminal: one bar with rows done of total, rows/s, generated tokens/s, errors so far and the time left.
When stderr is not a terminal (a Slurm log, a pipe): the same facts as one plain line at most every 30 s
(``BATCHJOB_PROGRESS_SECONDS`` changes the interval), so a log shows the job moving without filling up.
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
    def __init__(self, total: int | None, done: int, errors: int) -> None:
        self.total = total
        self.done = done
        self.errors = errors
        self.start_done = done
        self.tokens = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.every = float(os.environ.get("BATCHJOB_PROGRESS_SECONDS", "30"))
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
        if self.total is not None and rate > 0:
            eta = f", ETA {_duration(max(0, self.total - self.done) / rate)}"
        return (
            f"batchjob: {self.done:,}{total} rows{pct}, {rate:.2f} rows/s, {self.tokens / elapsed:.1f} tok/s, "
            f"{self.errors} errors{eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
