"""The job's state folder ``OUT/_batchjob/``: identity, lock, in-flight checkpoint.

- ``job.json``: the fingerprint (what makes two runs the same job), the job seed, the input schema, and the
  total row count once known. A resume whose fingerprint differs is refused, naming what changed.
- ``manifest.jsonl``: committed parts (see ``manifest.py``).
- ``inflight.json``: the unfinished requests at the last checkpoint: row ordinal, id, prompt ids, generated ids.
- ``stats.json``: see ``stats.py``. ``lock``: held by the running process, so two runs never share a folder.

JSON files are replaced atomically and carry a checksum; a torn or altered one raises StateError.
"""

from __future__ import annotations

import base64
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchjob.errors import StateError
from batchjob.io.atomic import read_json, write_json

STATE_DIR = "_batchjob"
VERSION = 1


class JobMismatchError(StateError):
    """The output folder holds a different job (model, inputs, prompts or sampling changed)."""

    exit_code = 2


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Human-readable differences, e.g. ``"sampling.temperature: was 0.0, now 1.0"``."""
    a, b = _flatten(saved), _flatten(now)
    return [
        f"{k}: was {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
    ]


@dataclass
class JobInfo:
    fingerprint: dict[str, Any]
    job_seed: int
    schema: pa.Schema
    total_rows: int | None = None
    complete: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "job_seed": self.job_seed,
            "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode(),
            "total_rows": self.total_rows,
            "complete": self.complete,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], path: Path) -> JobInfo:
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["schema"])))
            return cls(
                d["fingerprint"], int(d["job_seed"]), schema, d.get("total_rows"), bool(d.get("complete"))
            )
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as e:
            raise StateError(f"state file {path} is not a batchjob job file ({e})") from e


class StateDir:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / STATE_DIR
        self._lock_fd: int | None = None

    job_file = property(lambda self: self.path / "job.json")
    manifest_file = property(lambda self: self.path / "manifest.jsonl")
    inflight_file = property(lambda self: self.path / "inflight.json")
    stats_file = property(lambda self: self.path / "stats.json")

    def exists(self) -> bool:
        return self.job_file.exists()

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        """Hold the folder's lock for the life of the process (the kernel drops it if we are killed)."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            raise StateError(
                f"another batchjob run is writing to {self.out_dir}; wait for it or stop it"
            ) from e
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load_job(self) -> JobInfo:
        return JobInfo.from_json(read_json(self.job_file), self.job_file)

    def save_job(self, info: JobInfo) -> None:
        write_json(self.job_file, info.to_json())

    def load_inflight(self) -> dict[int, dict[str, Any]]:
        """The checkpointed unfinished requests by row ordinal (empty when there is no checkpoint)."""
        if not self.inflight_file.exists():
            return {}
        body = read_json(self.inflight_file)
        try:
            return {int(r["ordinal"]): r for r in body["requests"]}
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"checkpoint {self.inflight_file} is malformed ({e})") from e

    def save_inflight(self, requests: list[dict[str, Any]]) -> None:
        write_json(self.inflight_file, {"requests": requests})

    def clear_inflight(self) -> None:
        if self.inflight_file.exists():
            self.inflight_file.unlink()
