"""Helpers for tests that stop a real ``batchjob`` process at a fault point (``batchjob/faults.py``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from batchjob.job import make_spec, run_job
from tests.jobproc import read_results

_POINT = re.compile(r"fault point (\S+) \(pid (\d+)\)")
TEMPLATE = "Review: {review}\nSentiment:"


def write_reviews(path: Path, n: int) -> Path:
    """``n`` JSONL rows with ids ``r00``.. and a torn last line (an error row)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"rid": f"r{i:02d}", "review": f"item {i} was {'good' if i % 3 else 'bad'}"}))
            f.write("\n")
        f.write("{torn json\n")
    return path


def job_args(reviews, out, model, *extra) -> list[str]:
    """Seeded sampling: a resumed (or sharded) job must reproduce an uninterrupted one token for token."""
    args = ["--input", reviews, "--output", out, "--model", model, "--template", TEMPLATE]
    args += ["--id-column", "rid", "--max-new-tokens", "6", "--temperature", "0.9", "--seed", "5"]
    args += ["--max-num-seqs", "2"]
    return [str(a) for a in [*args, *extra]]


def reference(reviews, model, out) -> list[dict]:
    """The results of an uninterrupted in-process run of ``job_args``'s job."""
    spec = make_spec(
        input=[str(reviews)],
        output=str(out),
        model=str(model),
        template=TEMPLATE,
        id_column="rid",
        max_new_tokens=6,
        temperature=0.9,
        seed=5,
    )
    assert run_job(spec).status == "complete"
    return read_results(out)


def wait_for_points(proc, count: int = 1) -> tuple[list[int], str]:
    """Read ``proc``'s output until ``count`` processes have announced their fault point; their pids, and the
    output so far. (No sleeping: the line is printed once the process waits for a signal there.)"""
    pids: list[int] = []
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        for match in _POINT.finditer(line):  # (two processes' lines may share one: count each)
            pids.append(int(match.group(2)))
        if len(pids) >= count:
            return pids, "".join(seen)
    raise AssertionError(f"the process ended before its fault point:\n{''.join(seen)}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids, timeout: float = 30.0) -> list[int]:
    """Poll until none of ``pids`` runs, at most ``timeout`` seconds; the ones still running."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def temp_files(out: Path) -> list[Path]:
    """Temporary files left anywhere under the output folder."""
    return [p for p in out.rglob("*") if p.name.endswith(".tmp")]
