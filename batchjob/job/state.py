"""The job's state folder ``OUT/_batchjob/``: identity, lock, in-flight checkpoint.

- ``job.json``: the fingerprint (what makes two runs the same job), the job seed, the input schema, a record
  of each input file (``inputs.py``: identity by content, row count once known), and for what inputs the job
  was complete. A resume whose fingerprint differs is refused, naming what changed.
- ``manifest.jsonl``: committed parts (see ``manifest.py``).
- ``inflight.json``: the unfinished rows at the last checkpoint (``checkpoint.InFlight``): row ordinal, id,
  prompt ids, generated ids.
- ``stats.json``: see ``stats.py``. ``lock``: held by the running process, so two runs never share a folder.

A job split over several workers (``shard.py``) shares one ``job.json``, created once by whichever worker
comes first (an exclusive link, so two workers starting together still agree on the job seed and chunk size)
and never rewritten; each worker keeps the rest in its own folder ``_batchjob/shard-00003-of-00008/``, with
``progress.json`` holding the row counts it learned and for what inputs its share is complete. A one-worker job keeps everything
directly in ``_batchjob/``.

JSON files are replaced atomically and carry a checksum; a torn or altered one raises StateError, except the
in-flight checkpoint: that one is set aside and its requests recomputed (``load_inflight``).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchjob.errors import StateError
from batchjob.io.atomic import CorruptStateError, fsync_dir, read_json, write_json
from batchjob.job.checkpoint import InFlight
from batchjob.job.inputs import InputRecord, digest_records
from batchjob.job.shard import Shard

STATE_DIR = "_batchjob"
VERSION = 2  # 2: inputs recorded by content, ordinals per file


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


def differing(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The dotted names of the fingerprint entries that differ."""
    a, b = _flatten(saved), _flatten(now)
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def fingerprint_changes(
    saved: dict[str, Any],
    now: dict[str, Any],
    defaults: Mapping[str, Any] | None = None,
    sides: tuple[str, str] = ("was", "now"),
) -> list[str]:
    """Human-readable differences, e.g. ``"sampling.temperature: was 0.0, now 1.0"``. ``defaults``: entries'
    ``job.defaults.Default`` by name: a default spelled out as the value it surely resolves to is no change,
    and a default named in a message says what it resolves to. ``sides``: the words before each value."""
    a, b = _flatten(saved), _flatten(now)
    out = []
    for k in differing(saved, now):
        was, is_ = a.get(k), b.get(k)
        d = (defaults or {}).get(k)
        if d is not None and (was == d.word) != (is_ == d.word):
            other = is_ if was == d.word else was
            if d.sure and other == d.value:
                continue  # the default, spelled out (or left out again): the same job
            words = [d.describe() if v == d.word else repr(v) for v in (was, is_)]
            out.append(f"{k}: {sides[0]} {words[0]}, {sides[1]} {words[1]}")
            continue
        out.append(f"{k}: {sides[0]} {was!r}, {sides[1]} {is_!r}")
    return out


def _counts_for(info: JobInfo, progress: Mapping[str, Any]) -> dict[int, int]:
    """A worker's row counts that hold for the job's input records now. Another worker's ``--append`` may
    have taken in more rows of a file since this one counted it: its count (40 of a file that has 60 rows
    now) is then for an older record, and is left out (status said 45 of 40 rows). A progress file of an
    older batchjob (no ``rows_for``) vouches for its counts only where the worker is complete for these
    inputs."""
    counts, rows_for = progress.get("rows") or {}, progress.get("rows_for")
    now = {str(r.seq): digest_records([r]) for r in info.inputs}
    if rows_for is None:
        return {int(k): v for k, v in counts.items()} if info.complete else {}
    return {int(k): v for k, v in counts.items() if k in now and rows_for.get(k) == now[k]}


@dataclass
class JobInfo:
    fingerprint: dict[str, Any]  # model, prompt construction, sampling, sharding: what makes it this job
    job_seed: int
    schema: pa.Schema
    inputs: list[InputRecord] = field(default_factory=list)  # every input file the job has taken in
    complete_for: str | None = None  # this worker's share was done for these inputs (digest_records)
    chunk_rows: int | None = None  # shard assignment unit (shard.py); None for a one-worker job
    input_paths: list[str] = field(default_factory=list)  # --input as given (local ones absolute): for status

    @property
    def complete(self) -> bool:
        return self.complete_for is not None and self.complete_for == digest_records(self.inputs)

    def mark_complete(self) -> None:
        self.complete_for = digest_records(self.inputs)

    @property
    def row_counts(self) -> dict[int, int | None]:
        return {r.seq: r.rows for r in self.inputs}

    @property
    def total_rows(self) -> int | None:
        """All rows of the job's inputs, once every file's count is known."""
        counts = list(self.row_counts.values())
        return None if None in counts else sum(counts)  # type: ignore[arg-type]

    def set_counts(self, counts: dict[int, int]) -> None:
        for r in self.inputs:
            if r.seq in counts:
                r.rows = counts[r.seq]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "job_seed": self.job_seed,
            "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode(),
            "inputs": [r.to_json() for r in self.inputs],
            "complete_for": self.complete_for,
            "chunk_rows": self.chunk_rows,
            "input_paths": self.input_paths,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], path: Path) -> JobInfo:
        if d.get("version") != VERSION:
            raise StateError(
                f"state file {path} was written by another version of batchjob (state version "
                f"{d.get('version')!r}, this one reads {VERSION}): finish the job with that version, or give "
                "a new --output"
            )
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["schema"])))
            return cls(
                d["fingerprint"],
                int(d["job_seed"]),
                schema,
                [InputRecord.from_json(r) for r in d["inputs"]],
                d.get("complete_for"),
                d.get("chunk_rows"),
                list(d.get("input_paths") or []),
            )
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as e:
            raise StateError(f"state file {path} is not a batchjob job file ({e})") from e


class StateDir:
    def __init__(self, out_dir: Path, shard: Shard | None = None) -> None:
        self.out_dir = out_dir
        self.shard = shard or Shard()
        self.path = out_dir / STATE_DIR
        self.work = self.path if self.shard.single else self.path / self.shard.name  # this worker's files
        self._lock_fd: int | None = None

    job_file = property(lambda self: self.path / "job.json")
    manifest_file = property(lambda self: self.work / "manifest.jsonl")
    inflight_file = property(lambda self: self.work / "inflight.json")
    stats_file = property(lambda self: self.work / "stats.json")
    progress_file = property(lambda self: self.work / "progress.json")
    lock_file = property(lambda self: self.work / "lock")
    images_file = property(lambda self: self.path / "images.json")  # --image-column's files (images.py)

    def exists(self) -> bool:
        return self.job_file.exists()

    def other_manifests(self) -> list[Path]:
        """The manifest files of the job's other workers (which may not exist yet)."""
        count = self.shard.count
        others = [Shard(i, count) for i in range(count) if i != self.shard.index]
        return [StateDir(self.out_dir, shard).manifest_file for shard in others]

    def create(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        """Hold the folder's lock for the life of the process (the kernel drops it if we are killed)."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            who = "" if self.shard.single else f" as {self.shard}"
            raise StateError(
                f"another batchjob run is writing to {self.out_dir}{who}; wait for it or stop it"
            ) from e
        self._lock_fd = fd
        # who holds it, for `status` (the lock itself is the kernel's: this text only describes it)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)

    def lock_holder(self) -> dict[str, Any]:
        """What the running process wrote in the lock file (pid, host, since), or {} (for ``status``)."""
        try:
            holder = json.loads(self.lock_file.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def locked_by_other(self) -> bool:
        """Whether a running process holds this worker's lock (for ``status``)."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def load_job(self) -> JobInfo:
        info = JobInfo.from_json(read_json(self.job_file), self.job_file)
        if not self.shard.single:
            progress = read_json(self.progress_file) if self.progress_file.exists() else {}
            info.complete_for = progress.get("complete_for")
            info.set_counts(_counts_for(info, progress))
        return info

    def save_job(self, info: JobInfo) -> None:
        """Save the job's progress: into job.json for one worker, else into this worker's progress.json (each
        row count with the input record it was counted for)."""
        if self.shard.single:
            write_json(self.job_file, info.to_json())
        else:
            counted = [r for r in info.inputs if r.rows is not None]
            rows = {str(r.seq): r.rows for r in counted}
            rows_for = {str(r.seq): digest_records([r]) for r in counted}
            write_json(
                self.progress_file, {"complete_for": info.complete_for, "rows": rows, "rows_for": rows_for}
            )

    def create_job(self, info: JobInfo) -> bool:
        """Write job.json unless it exists; False when another worker created it first."""
        shared = JobInfo(
            info.fingerprint,
            info.job_seed,
            info.schema,
            info.inputs,
            chunk_rows=info.chunk_rows,
            input_paths=info.input_paths,
        )
        tmp = self.path / f".job.json.{os.getpid()}.tmp"
        write_json(tmp, shared.to_json())
        try:
            os.link(tmp, self.job_file)  # atomic and exclusive, even when workers start together
            fsync_dir(self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def job_lock(self) -> Iterator[None]:
        """Held while the job's shared records (job.json) are read and rewritten by one of several workers."""
        fd = os.open(self.path / "job.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def save_inputs(self, info: JobInfo) -> None:
        """Replace the job's input records (``--append`` took in new rows); hold ``job_lock``."""
        if self.shard.single:
            return  # saved with the rest of job.json by save_job
        shared = JobInfo.from_json(read_json(self.job_file), self.job_file)
        shared.inputs, shared.input_paths = info.inputs, info.input_paths
        write_json(self.job_file, shared.to_json())

    def load_inflight(self) -> dict[int, InFlight]:
        """The checkpointed unfinished requests by row ordinal (empty when there is no checkpoint).

        A torn or corrupt checkpoint costs only recomputation: it is set aside (renamed, kept for a look)
        and its requests start again from their prompts. Committed rows are untouched, and a request's
        tokens depend only on (seed, id, position), so the results are the same.
        """
        if not self.inflight_file.exists():
            return {}
        try:
            body = read_json(self.inflight_file)
            return {r.ordinal: r for r in map(InFlight.from_json, body["requests"])}
        except (CorruptStateError, KeyError, TypeError, ValueError) as e:
            reason = e.reason if isinstance(e, CorruptStateError) else f"is malformed ({e!r})"
            aside = self._set_aside(self.inflight_file)
            print(
                f"batchjob: warning: checkpoint {self.inflight_file} {reason}; set aside as "
                f"{aside.name}. Its requests start again from their prompts (committed rows are kept and "
                "the results are the same)",
                file=sys.stderr,
            )
            return {}

    def _set_aside(self, path: Path) -> Path:
        """Rename a damaged state file to ``<name>.corrupt-<UTC time>`` next to it (under the state folder,
        where Parquet readers do not look)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        os.replace(path, aside)
        fsync_dir(path.parent)
        return aside

    def save_inflight(self, requests: list[InFlight]) -> None:
        write_json(self.inflight_file, {"requests": [r.to_json() for r in requests]})

    def clear_inflight(self) -> None:
        if self.inflight_file.exists():
            self.inflight_file.unlink()
