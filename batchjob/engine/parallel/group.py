"""The ranks of one tensor-parallel engine, and the one message that goes to them each step.

Rank 0 is the engine the caller holds: it runs the scheduler, sampling and everything above. It starts ranks
1..N-1 itself, as processes on this node (``python -m batchjob.engine.parallel.follower``). Before each forward
it broadcasts the step's layout (:class:`~batchjob.engine.attention.StepLayout`) as two int64 tensors, a
header and the arrays one after another; every other rank rebuilds the layout and runs the same forward on
its shard of the weights and its own KV heads. The row-parallel all-reduces inside the forward keep the
ranks in step. Block ids are in the layout, so the KV pools (the same number of blocks on every rank, the
smallest any rank could hold) are filled identically.

Failures: rank 0 waits on a collective at most ``BATCHJOB_TP_TIMEOUT`` seconds (default 120); a rank that
died (its socket closes at once) or hung ends the step with :class:`~batchjob.errors.RankError` naming the
rank, and the other ranks are stopped. A follower ignores SIGTERM/SIGINT (its rank 0 decides when to stop,
after saving its state) and is killed by the kernel if rank 0 dies.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from batchjob.engine.attention import StepLayout
from batchjob.errors import ConfigError, RankError

TIMEOUT_ENV = "BATCHJOB_TP_TIMEOUT"  # seconds rank 0 waits for the other ranks in a collective
DEVICES_ENV = "BATCHJOB_TP_DEVICES"  # the ranks' devices, comma-separated (the --devices launcher sets it)
STOP, LOGITS, HIDDEN = 0, 1, 2  # what a step asks for (the header's first number)
_HEADER = 5  # kind, rows T, requests R, block-table width B, sampled rows S
_FOLLOWER_WAIT = timedelta(days=7)  # a follower waits for rank 0's next step as long as rank 0 lives


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Each rank's device: ``BATCHJOB_TP_DEVICES`` when set, else the CPU for every rank, else consecutive
    CUDA devices from rank 0's."""
    listed = os.environ.get(DEVICES_ENV)
    if listed:
        names = [d for d in listed.split(",") if d]
        if len(names) != size:
            raise ConfigError(f"{DEVICES_ENV}={listed!r} names {len(names)} devices for {size} ranks")
        return [torch.device(d) for d in names]
    if device.type == "cpu":
        return [device] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise ConfigError(
            f"tensor_parallel_size {size} from {device} needs CUDA devices {first}..{first + size - 1}, "
            f"but this machine has {torch.cuda.device_count()}"
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def _timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV, "120")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follower_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for a follower: killed with its rank 0; deaf to SIGTERM/SIGINT (rank 0 stops it).
    prctl is looked up here, in the parent: the child between fork and exec only calls it."""
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if prctl is not None:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return preexec


class Group:
    """This process's place among the ranks, the collectives the engine uses, and their cost so far."""

    def __init__(self, rank: int, size: int, device: torch.device, timeout: float) -> None:
        self.rank, self.size, self.device, self.timeout = rank, size, device, timeout
        self.procs: list[subprocess.Popen[bytes]] = []  # rank 0: ranks 1..N-1
        self.store: Any = None
        self.closed = False
        self.reduce_calls = 0  # all-reduces inside forwards
        self.reduce_bytes = 0
        self.reduce_seconds = 0.0
        self.broadcast_bytes = 0

    # -- starting ------------------------------------------------------------------------------------

    @classmethod
    def start(cls, size: int, device: torch.device, follower_spec: dict[str, Any]) -> Group:
        """Rank 0: start ranks 1..size-1 on this node (they load their shards while rank 0 loads its own;
        then :meth:`wait_ready` and :meth:`connect`)."""
        if dist.is_initialized():
            raise ConfigError(
                "this process already runs a tensor-parallel engine (or another torch.distributed group); "
                "close it first (engine.close()): one per process"
            )
        devices = rank_devices(device, size)
        port = _free_port()
        group = cls(0, size, devices[0], _timeout())
        atexit.register(group.close)
        group.store = dist.TCPStore(
            "127.0.0.1", port, size, True, timeout=_FOLLOWER_WAIT, wait_for_workers=False
        )
        for r in range(1, size):
            spec = dict(follower_spec, rank=r, size=size, port=port, device=str(devices[r]))
            cmd = [sys.executable, "-m", "batchjob.engine.parallel.follower", json.dumps(spec)]
            group.procs.append(subprocess.Popen(cmd, preexec_fn=_follower_preexec()))
        return group

    @classmethod
    def join(cls, spec: dict[str, Any]) -> Group:
        """Ranks 1..N-1: reach rank 0's store (the collectives start with :meth:`connect`)."""
        group = cls(spec["rank"], spec["size"], torch.device(spec["device"]), _FOLLOWER_WAIT.total_seconds())
        group.store = dist.TCPStore("127.0.0.1", spec["port"], group.size, False, timeout=_FOLLOWER_WAIT)
        return group

    def ready(self) -> None:
        """A follower: its shard is loaded."""
        self.store.set(f"ready{self.rank}", "1")

    def wait_ready(self) -> None:
        """Rank 0: wait while the other ranks start and load their shards (as long as it takes), stopping at
        once with the rank's name if one of them exits instead."""
        keys = [f"ready{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            self._check_alive("while starting or loading its shard of the model")
            time.sleep(0.1)

    def connect(self) -> None:
        """Every rank, its shard loaded: form the process group (rank 0's collectives time out after
        ``BATCHJOB_TP_TIMEOUT``)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        wait = timedelta(seconds=self.timeout)
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=self.size, timeout=wait)

    # -- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (the row-parallel linears' outputs)."""
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise self.failure(e) from None
        self.reduce_calls += 1
        self.reduce_bytes += t.numel() * t.element_size()
        self.reduce_seconds += time.perf_counter() - t0

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of any rank (the KV pool every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as e:
            raise self.failure(e) from None
        return int(t.item())

    def send_step(self, kind: int, lay: StepLayout) -> None:
        """Rank 0: the step's layout to every rank."""
        r, b = lay.table.shape
        header = torch.tensor([kind, len(lay.ids), r, b, len(lay.sample_rows)], dtype=torch.int64)
        arrays = [getattr(lay, name) for name in _FIELDS]
        body = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]))
        self._check_alive("before a step")
        try:
            dist.broadcast(header.to(self.device), 0)
            dist.broadcast(body.to(self.device), 0)
        except RuntimeError as e:
            raise self.failure(e) from None
        self.broadcast_bytes += (header.numel() + body.numel()) * 8

    def receive_step(self) -> tuple[int, StepLayout | None]:
        """Ranks 1..N-1: the next step's kind and layout (None with STOP)."""
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0)
        kind, t, r, b, s = header.tolist()
        if kind == STOP:
            return STOP, None
        sizes = {"rows": t, "reqs": r, "reqs+1": r + 1, "table": r * b, "sampled": s}
        body = torch.empty(sum(sizes[_FIELDS[n]] for n in _FIELDS), dtype=torch.int64, device=self.device)
        dist.broadcast(body, 0)
        flat = body.cpu().numpy()
        parts, at = {}, 0
        for name, size in _FIELDS.items():
            parts[name] = flat[at : at + sizes[size]]
            at += sizes[size]
        parts["table"] = parts["table"].reshape(r, b)
        parts["sample_mask"] = parts["sample_mask"].astype(bool)
        return kind, StepLayout(**parts)

    # -- failures and the end ------------------------------------------------------------------------

    def _dead(self) -> list[str]:
        dead = []
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
                dead.append(f"tensor-parallel rank {r} (pid {p.pid}) died ({how})")
        return dead

    def _check_alive(self, when: str) -> None:
        dead = self._dead()
        if dead:
            self.close()
            raise RankError(f"{'; '.join(dead)} {when}; the other ranks were stopped. {_RESUME}")

    def failure(self, error: Exception) -> RankError:
        """The error a failed collective becomes, naming the rank that died (seen within a second or two),
        else saying the ranks did not answer in time; the other ranks are stopped."""
        deadline = time.monotonic() + 2.0
        dead = self._dead()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead()
        self.close(force=True)
        if dead:
            return RankError(f"{'; '.join(dead)} during a step; the other ranks were stopped. {_RESUME}")
        return RankError(
            f"a tensor-parallel collective failed or did not finish within {self.timeout:g} s ({TIMEOUT_ENV}): "
            f"a rank hung or its connection broke ({str(error).splitlines()[0][:200]}); the ranks were "
            f"stopped. {_RESUME}"
        )

    def close(self, force: bool = False) -> None:
        """Rank 0: tell the other ranks to stop (or kill them, with ``force``), and wait for them."""
        if self.closed or self.rank != 0:
            return
        self.closed = True
        if not force and not self._dead() and dist.is_initialized():
            try:
                dist.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=self.device), 0)
            except RuntimeError:
                force = True
        for p in self.procs:
            try:
                p.wait(timeout=0 if force else 10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # a broken group: nothing more to release
                dist.destroy_process_group()

    def stats(self) -> dict[str, float]:
        return {
            "all_reduce_calls": self.reduce_calls,
            "all_reduce_bytes": self.reduce_bytes,
            "all_reduce_seconds": self.reduce_seconds,
            "broadcast_bytes": self.broadcast_bytes,
        }


_RESUME = "Run the same command again to resume the job."
# StepLayout's arrays in the order they travel, with the length each has.
_FIELDS = {
    "ids": "rows",
    "positions": "rows",
    "slots": "rows",
    "table": "table",
    "req_of_row": "rows",
    "starts": "reqs",
    "n": "reqs",
    "ends": "reqs",
    "offsets": "reqs+1",
    "drafts": "reqs",
    "sample_mask": "reqs",
    "sample_rows": "sampled",
}
