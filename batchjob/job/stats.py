"""Run statistics: token counts, throughput, per-request latencies and batch occupancy, in bounded memory.

Latencies are kept in a fixed-size reservoir sample (exact percentiles up to 10,000 requests, a uniform
sample beyond) and in log-spaced histograms with fixed edges (so workers' histograms add up), and the
timeline (per step: occupancy, tokens, KV blocks in use, preemptions) is halved whenever it grows past its
cap, so a stats object is the same size after a thousand rows or a billion. ``batchjob report`` draws them.
"""

from __future__ import annotations

import bisect
import random
import time
from typing import Any

_RESERVOIR = 10_000
_TIMELINE = 512
# Histogram edges in seconds: 10 per decade from 1 ms to 100,000 s (and an overflow bin).
HIST_EDGES = [round(10 ** (k / 10 - 3), 6) for k in range(81)]
TIMELINE_FIELDS = ["t", "occupancy", "generated_tokens", "prompt_tokens", "kv_used", "preemptions"]


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(HIST_EDGES) + 1)

    def add(self, x: float) -> None:
        self.counts[bisect.bisect_right(HIST_EDGES, x)] += 1

    def to_json(self) -> dict[str, Any]:
        return {"edges": HIST_EDGES, "counts": self.counts}


class Reservoir:
    def __init__(self, size: int = _RESERVOIR, seed: int = 0) -> None:
        self.size = size
        self.seen = 0
        self.values: list[float] = []
        self._rng = random.Random(seed)

    def add(self, x: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(x)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = x

    def summary(self) -> dict[str, float | int | None]:
        v = sorted(self.values)

        def pct(p: float) -> float | None:
            return round(v[min(len(v) - 1, int(p * len(v)))], 6) if v else None

        return {"count": self.seen, "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


class RunStats:
    """What one process run measured; job totals come from the manifest."""

    def __init__(self, max_num_seqs: int, engine: Any = None, lora: bool = False) -> None:
        """``engine``: the engine's stats now (an engine used before counts from here); ``lora``: a LoRA job,
        whose tokens are also counted by adapter."""
        self.start = time.monotonic()
        self.max_num_seqs = max_num_seqs
        self.rows = 0  # input rows finished
        self.samples = 0  # their result rows (--n N: N a row)
        self.errors = 0  # input rows with an error
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.images = 0  # the finished rows' images (--image-column)
        # a LoRA job: this run's [prompt, generated] tokens by adapter ("": the base model); None otherwise
        self.adapters: dict[str, list[int]] | None = {} if lora else None
        self.queue_wait = Reservoir(seed=1)
        self.ttft = Reservoir(seed=2)
        self.latency = Reservoir(seed=3)
        self.histograms = {"queue_wait_s": Histogram(), "ttft_s": Histogram(), "latency_s": Histogram()}
        # per recorded step, TIMELINE_FIELDS: seconds since start, running / max_num_seqs, and the engine's
        # cumulative generated and computed prompt tokens, KV blocks in use / all, cumulative preemptions
        self.timeline: list[list[float]] = []
        self._occ_every = 1
        self._occ_steps = 0
        self._kv_sum = engine.kv_blocks_used_sum if engine is not None else 0
        self._running_sum = engine.running_sum if engine is not None else 0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def row(
        self,
        prompt_tokens: int,
        generated_tokens: int,
        error: bool,
        samples: int = 1,
        images: int = 0,
        adapter: str | None = None,
    ) -> None:
        """An input row finished: its prompt once (and its images), all its samples' tokens; a LoRA job's
        also under the row's ``adapter`` (None: the base model)."""
        if self.adapters is not None:
            tokens = self.adapters.setdefault(adapter or "", [0, 0])
            tokens[0] += prompt_tokens
            tokens[1] += generated_tokens
        self.rows += 1
        self.images += images
        self.samples += samples
        self.errors += int(error)
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens

    def request(self, out: Any) -> None:
        """Timings of a finished engine request (``RequestOutput``: monotonic seconds)."""
        scheduled = out.first_scheduled_time
        values = {}
        if scheduled is not None:
            values["queue_wait_s"] = max(0.0, scheduled - out.arrival_time)
        if out.first_token_time is not None:
            values["ttft_s"] = max(0.0, out.first_token_time - out.arrival_time)
        values["latency_s"] = max(0.0, out.finish_time - out.arrival_time)
        for name, x in values.items():
            {"queue_wait_s": self.queue_wait, "ttft_s": self.ttft, "latency_s": self.latency}[name].add(x)
            self.histograms[name].add(x)

    def step(self, engine: Any) -> None:
        """After an engine step, from the engine's stats (``EngineStats``): it adds up, at each step, the
        requests that ran and the blocks in use, so this step's are the rise (one count of occupancy, the
        engine's)."""
        self._occ_steps += 1
        running, self._running_sum = engine.running_sum - self._running_sum, engine.running_sum
        used, self._kv_sum = engine.kv_blocks_used_sum - self._kv_sum, engine.kv_blocks_used_sum
        if self._occ_steps % self._occ_every:
            return
        point = [
            round(self.elapsed, 3),
            round(running / self.max_num_seqs, 4),
            engine.generated_tokens,
            engine.computed_prompt_tokens,
            round(used / max(1, engine.num_blocks), 4),
            engine.preemptions,
        ]
        self.timeline.append(point)
        if len(self.timeline) >= _TIMELINE:
            self.timeline = self.timeline[::2]
            self._occ_every *= 2

    @property
    def occupancy(self) -> list[list[float]]:
        return [p[:2] for p in self.timeline]

    def to_json(self, engine_stats: dict[str, Any] | None = None) -> dict[str, Any]:
        elapsed = max(self.elapsed, 1e-9)
        occ = [o for _, o in self.occupancy]
        images = {"images": self.images, "images_per_s": round(self.images / elapsed, 3)}
        extra = (images if self.images else {}) | self._adapters_json(elapsed)
        return extra | {
            "elapsed_s": round(elapsed, 3),
            "rows": self.rows,
            "samples": self.samples,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rows_per_s": round(self.rows / elapsed, 3),
            "generated_tokens_per_s": round(self.generated_tokens / elapsed, 3),
            "total_tokens_per_s": round((self.prompt_tokens + self.generated_tokens) / elapsed, 3),
            "preemptions": (engine_stats or {}).get("preemptions", 0),
            "queue_wait_s": self.queue_wait.summary(),
            "ttft_s": self.ttft.summary(),
            "latency_s": self.latency.summary(),
            "batch_occupancy": {
                "max_num_seqs": self.max_num_seqs,
                "mean": round(sum(occ) / len(occ), 4) if occ else None,
                "timeline": self.occupancy,
            },
            "histograms": {k: h.to_json() for k, h in self.histograms.items()},
            "timeline": {"fields": TIMELINE_FIELDS, "points": self.timeline},
            "engine": engine_stats or {},
        }

    def _adapters_json(self, elapsed: float) -> dict[str, Any]:
        """A LoRA job's ``adapters``: each adapter's tokens of this run and their rates (an adapter that ran
        nothing in this run is not listed: its rate is 0)."""
        if self.adapters is None:
            return {}
        return {
            "adapters": {
                name: {
                    "prompt_tokens": prompt,
                    "generated_tokens": generated,
                    "generated_tokens_per_s": round(generated / elapsed, 3),
                    "total_tokens_per_s": round((prompt + generated) / elapsed, 3),
                }
                for name, (prompt, generated) in self.adapters.items()
            }
        }
