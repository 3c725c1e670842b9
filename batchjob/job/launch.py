"""Starting several workers of one job from one command: a process per device, or a Ray task per GPU/CPU.

Each worker is an ordinary ``run_job`` over one shard (``shard.py``) of the same output folder, so resume and
``batchjob status`` work the same however the workers were started. The launcher only starts them, passes
SIGTERM/SIGINT on (each worker then saves its state and exits 75), and returns the worst exit code.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchjob import faults, signals
from batchjob.errors import BatchjobError, ConfigError
from batchjob.job.loop import EXIT_INTERRUPTED
from batchjob.job.shard import Shard
from batchjob.job.spec import JobSpec

# worst last: a usage error (2) beats a failure (1), which beats "requeue me" (75), which beats done (0)
_SEVERITY = {0: 0, 75: 1, 1: 2, 2: 3}


def worst_exit(codes: Sequence[int]) -> int:
    """The exit code that says the most about a set of workers; a worker killed by a signal counts as 1."""
    mapped = [c if c in _SEVERITY else 1 for c in codes]
    return max(mapped, key=_SEVERITY.__getitem__, default=0)


def parse_devices(value: str) -> list[str]:
    from batchjob.engine.options import DEVICE_NAME

    devices = [d.strip() for d in value.split(",") if d.strip()]
    if not devices:
        raise ConfigError("--devices needs a list such as cuda:0,cuda:1")
    for d in devices:
        if not DEVICE_NAME.match(d) or d == "auto":
            raise ConfigError(f"--devices: {d!r} is not a device (cpu, cuda or cuda:N)")
    return devices


def worker_devices(devices: list[str], ranks: int) -> list[list[str]]:
    """The devices of each worker: ``ranks`` consecutive devices per worker (its tensor-parallel ranks;
    one device each without tensor parallelism)."""
    if len(devices) % ranks:
        raise ConfigError(
            f"--devices lists {len(devices)} devices, not a multiple of --tensor-parallel-size {ranks}: each "
            f"worker takes {ranks} of them"
        )
    return [devices[i : i + ranks] for i in range(0, len(devices), ranks)]


class _Forward:
    """While the workers start and run, a SIGTERM/SIGINT to the launcher goes to each of them (once), and no
    further worker is started (``handle`` is the launcher's handler, under ``signals.handling``)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.signum: int | None = None  # the signal received, if any
        self._sent: set[int] = set()  # pids it has been passed on to

    def handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.forward()

    def forward(self) -> None:
        """Pass the signal received on to every running worker that has not had it (one started while the
        handler ran is caught by the next call)."""
        if self.signum is None:
            return
        for p in self.procs:
            if p.pid not in self._sent and p.poll() is None:
                p.send_signal(self.signum)
                self._sent.add(p.pid)


def run_devices(devices: list[str], outer: Shard, worker_args: list[str], ranks: int = 1) -> list[int]:
    """One ``batchjob run`` process per device (per ``ranks`` devices with tensor parallelism: the worker
    runs on the first and starts its other ranks on the rest, ``BATCHJOB_TP_DEVICES``); returns their exit
    codes.

    Worker ``p`` on device ``devices[p]`` runs shard ``outer.index * D + p`` of ``outer.count * D``, so
    ``--devices`` also composes with a Slurm array or explicit shard flags (each array task runs D workers).
    A signal stops the start of further workers (those count as interrupted, 75); a worker the signal
    reached before its handlers were in place (killed by it) also counts as interrupted. The workers die
    with the launcher: SIGTERM from the kernel on Linux, else their own watch (``signals.py``).
    """
    groups = worker_devices(devices, ranks)
    n = len(groups)
    procs: list[subprocess.Popen[bytes]] = []
    labels = [
        f"{Shard(outer.index * n + pos, outer.count * n)} on {','.join(g)}" for pos, g in enumerate(groups)
    ]
    env = dict(os.environ, **{signals.PARENT_ENV: str(os.getpid())})
    faults.point("launch")
    fwd = _Forward(procs)
    with signals.handling(fwd.handle):
        for pos, group in enumerate(groups):
            if fwd.signum is not None:
                break
            shard = Shard(outer.index * n + pos, outer.count * n)
            cmd = [sys.executable, "-m", "batchjob", "run", *worker_args, "--device", group[0]]
            cmd += ["--num-shards", str(shard.count), "--shard-index", str(shard.index)]
            ranks_env = {"BATCHJOB_TP_DEVICES": ",".join(group)} if ranks > 1 else {}
            procs.append(
                subprocess.Popen(cmd, env=dict(env, **ranks_env), preexec_fn=signals.worker_preexec())
            )
            fwd.forward()
            if pos == 0:
                faults.point("worker_started")
        fwd.forward()
        codes = [p.wait() for p in procs]
    stopped_by = {-fwd.signum} if fwd.signum is not None else set()
    report = []
    for label, code in zip(labels, codes + [None] * (n - len(codes)), strict=True):
        if code is None:
            report.append(EXIT_INTERRUPTED)
            print(f"batchjob: worker {label}: not started (interrupted)", file=sys.stderr)
            continue
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        if code in stopped_by:  # the signal came before its handlers: nothing to save
            how, code = f"{how} (interrupted while starting)", EXIT_INTERRUPTED
        report.append(code)
        print(f"batchjob: worker {label}: {how}", file=sys.stderr)
    return report


# -- Ray ---------------------------------------------------------------------------------------------------


def _absolute(spec: JobSpec) -> JobSpec:
    """Paths a Ray worker can open from any working directory (on a shared filesystem)."""

    def local(p: str) -> str:
        return p if "://" in p else os.path.abspath(p)

    def folder(p: str) -> str:  # a model or adapter folder here (else a hub id, left as it is)
        return os.path.abspath(p) if Path(p).exists() else p

    model = folder(spec.model) if spec.model else spec.model
    lora = [f"{name}={folder(path)}" for name, path in spec.lora_paths.items()]  # by content: same identity
    return dataclasses.replace(
        spec, input=[local(p) for p in spec.input], output=local(spec.output or ""), model=model, lora=lora
    )


def _ray_worker(spec: JobSpec, index: int, count: int) -> tuple[int, str]:
    """The body of one Ray task: this shard of the job, as ``(exit code, one line)``."""
    from batchjob.job.runner import run_job

    faults.die(f"ray_task{index}")
    shard = Shard(index, count, "--ray")
    try:
        result = run_job(spec, shard=shard)
    except BatchjobError as e:
        return e.exit_code, f"{shard}: {e}"
    return result.exit_code, f"{shard}: {result.status}, {result.rows_done} of {result.rows_total} rows"


def saved_num_shards(out_dir: Path) -> int | None:
    from batchjob.job.state import StateDir

    state = StateDir(out_dir)
    if not state.exists():
        return None
    return int((state.load_job().fingerprint.get("sharding") or {}).get("num_shards", 1))


def run_ray(spec: JobSpec, address: str | None, num_shards: int | None) -> list[int]:
    """Run the job as Ray tasks, one per GPU of the cluster (or per CPU slot when it has none).

    ``address``: a Ray cluster (``auto``, ``ray://host:10001``); None starts a local instance unless
    ``RAY_ADDRESS`` names one. The number of workers: ``num_shards``, else the saved job's (a resumed job
    keeps its split whatever the cluster's size now), else one per GPU or CPU. A task whose node dies is
    retried by Ray and resumes its shard from the (shared) output folder.
    """
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--ray needs Ray: pip install 'batchjob[ray]'") from e
    spec = _absolute(spec)
    ray.init(address=address or None, log_to_driver=True)
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if spec.engine.device != "cpu" else 0
        count = (
            num_shards or saved_num_shards(Path(spec.output or "")) or gpus or int(resources.get("CPU", 1))
        )
        if gpus:
            cuda = dataclasses.replace(spec.engine, device="cuda")  # Ray sets CUDA_VISIBLE_DEVICES per task
            spec = dataclasses.replace(spec, engine=cuda)
            task = ray.remote(num_gpus=1, max_retries=3)(_ray_worker)
        else:
            task = ray.remote(num_cpus=1, max_retries=3)(_ray_worker)
        per = f"{'GPU' if gpus else 'CPU slot'}"
        print(f"batchjob: {count} workers as Ray tasks, one per {per}", file=sys.stderr)
        refs: list[Any] = []
        stopping: list[int] = []

        def cancel(signum: int, frame: Any) -> None:
            stopping.append(signum)
            for ref in refs:
                ray.cancel(ref)  # a running task gets a KeyboardInterrupt: it saves its state and stops

        # in place before the first task: a signal from here on cancels what was submitted and submits no more
        codes = []
        with signals.handling(cancel):
            for i in range(count):
                if stopping:
                    codes.append(EXIT_INTERRUPTED)
                    print(f"batchjob: {Shard(i, count, '--ray')}: not started (interrupted)", file=sys.stderr)
                    continue
                refs.append(task.remote(spec, i, count))
            if stopping:  # a signal between submitting a task and listing it
                cancel(stopping[0], None)
            codes += [_ray_result(ray, ref, Shard(i, count, "--ray"), stopping) for i, ref in enumerate(refs)]
        return codes
    finally:
        ray.shutdown()


def _ray_result(ray: Any, ref: Any, shard: Shard, stopping: list[int]) -> int:
    """One task's exit code, said in a line. A task Ray could not finish (cancelled by a signal: 75; its worker
    crashed on every try, its node lost, its code raised: 1) is that shard's failure alone: the launcher
    goes on waiting for the others, which would die half done in ``ray.shutdown()`` if it stopped here."""
    try:
        code, line = ray.get(ref)
    except ray.exceptions.RayError as e:
        code = EXIT_INTERRUPTED if stopping else 1
        line = f"{shard}: {type(e).__name__}: {e}"
        if not stopping:
            line += f"\nbatchjob: {shard}: exit 1; its rows up to its last checkpoint are saved: run again to resume"
    print(f"batchjob: {line}", file=sys.stderr)
    return int(code)
