"""A job's progress read from its output folder alone, all workers added up; reads, never writes.

Every worker's share is described by its own manifest (rows, errors, tokens), ``progress.json`` (complete?)
and ``stats.json`` (throughput of its last run); whether it is running now is whether its lock is held. The
inputs are checked against the job's records, so a job whose inputs changed is never reported complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.errors import InputError
from batchjob.io.atomic import read_json
from batchjob.job.inputs import changes_now
from batchjob.job.manifest import Manifest
from batchjob.job.shard import Shard
from batchjob.job.state import StateDir


@dataclass
class WorkerStatus:
    shard: Shard
    state: str  # "complete" | "running" | "stopped" | "not started"
    rows_done: int = 0
    rows_total: int | None = None  # this worker's share
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    parts: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # of its last (or current) run
    stats_file: Path | None = None


@dataclass
class JobStatus:
    out_dir: Path
    workers: list[WorkerStatus]
    rows_total: int | None  # all rows of the job's input, once known
    input_changes: list[str] = field(default_factory=list)  # the inputs now differ from what the job read

    @property
    def complete(self) -> bool:
        return not self.input_changes and all(w.state == "complete" for w in self.workers)

    def total(self, key: str) -> int:
        return sum(getattr(w, key) for w in self.workers)

    def rate(self, key: str) -> float:
        """A throughput summed over the workers' last runs (over the running ones while any runs)."""
        running = [w for w in self.workers if w.state == "running"]
        return sum(float(w.stats.get(key, 0) or 0) for w in running or self.workers)


def job_status(out_dir: Path) -> JobStatus:
    root = StateDir(out_dir)
    if not root.exists():
        raise InputError(f"{out_dir} holds no batchjob job (no {root.job_file})")
    info = root.load_job()
    count = int((info.fingerprint.get("sharding") or {}).get("num_shards", 1))
    chunk_rows = info.chunk_rows or 1
    workers = []
    for i in range(count):
        shard = Shard(i, count, "the saved job", chunk_rows)
        state = StateDir(out_dir, shard)
        if not state.work.is_dir():
            workers.append(WorkerStatus(shard, "not started"))
            continue
        mine = state.load_job()
        manifest = Manifest(state.manifest_file)
        stats = read_json(state.stats_file) if state.stats_file.exists() else {}
        for r in mine.inputs:  # row counts a worker learned by reading to the end
            known = next(x for x in info.inputs if x.seq == r.seq)
            known.rows = known.rows if known.rows is not None else r.rows
        if mine.complete:
            run_state = "complete"
        else:
            run_state = "running" if state.locked_by_other() else "stopped"
        workers.append(
            WorkerStatus(
                shard,
                run_state,
                manifest.rows,
                None,
                manifest.errors,
                manifest.prompt_tokens,
                manifest.generated_tokens,
                len(manifest.parts),
                stats,
                state.stats_file,
            )
        )
    for w in workers:
        w.rows_total = w.shard.share_of(info.row_counts)
    return JobStatus(out_dir, workers, info.total_rows, changes_now(info.inputs, info.input_paths, out_dir))
