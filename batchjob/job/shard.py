"""Which rows a worker owns: shard assignment, and where a worker learns its shard index and count.

Each input file is cut into chunks of ``chunk_rows`` consecutive rows; chunk ``j`` of the file with sequence
number ``s`` (``batchjob.job.inputs``) is the job's chunk ``s + j``, and chunk ``c`` belongs to shard
``c % num_shards``. So a big file's chunks are dealt round-robin and many small files are spread one by one.
This needs no row counts (a gzipped JSONL file's length is unknown until it is read), is the same on every
worker, puts every row in exactly one shard, and does not move when files are added (``--append``). ``chunk_rows`` is chosen once, by the worker that creates the job, from the
row count when it is cheap to know (so that a small job still spreads over every worker), and saved with the
job: every worker then uses the saved value.

Shard index and count come, in this order of precedence, from:

1. ``--num-shards N --shard-index I`` (or ``BATCHJOB_NUM_SHARDS`` / ``BATCHJOB_SHARD_INDEX``);
2. torchrun (``RANK``, ``WORLD_SIZE``), else Slurm tasks (``SLURM_PROCID``, ``SLURM_NTASKS`` > 1), else a
   Kubernetes indexed job (``JOB_COMPLETION_INDEX``, with the count from ``--num-shards`` or
   ``BATCHJOB_NUM_SHARDS``);
3. a Slurm array (``SLURM_ARRAY_TASK_ID``, ``SLURM_ARRAY_TASK_COUNT``, ``SLURM_ARRAY_TASK_MIN``) multiplies
   with 2.: array task ``a`` of ``A``, each with ``T`` tasks, runs shards ``a*T .. a*T+T-1`` of ``A*T``; flags
   given inside an array task (the ``--devices`` launcher's workers) must name a shard of that block (where
   the array's variables can't place the task, the flags are taken as given).

Slurm tasks count only inside an ``srun`` step: a batch script asking for several tasks is refused.

Nothing found: one shard, the whole job.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from batchjob.errors import ConfigError
from batchjob.io.sources import ORDINAL_BITS
from batchjob.job.intervals import IntervalSet

_INDEX_MASK = (1 << ORDINAL_BITS) - 1

MAX_CHUNK_ROWS = 1024
_CHUNKS_PER_SHARD = 16  # a small job still gets this many chunks per shard, for balance
# ASCII digits only: int() reads Slurm's '1_0' (a het job's) as 10, and str.isdigit() passes '²', which
# int() then refuses with a traceback
_INTEGER = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1
    origin: str = "default"  # where index and count came from, for messages
    chunk_rows: int = MAX_CHUNK_ROWS  # set from the saved job before any row is read

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"num_shards must be >= 1, got {self.count} (from {self.origin})")
        if not 0 <= self.index < self.count:
            raise ConfigError(
                f"shard_index must be in 0..{self.count - 1} for {self.count} shards, got {self.index} "
                f"(from {self.origin})"
            )
        if self.chunk_rows < 1:
            raise ConfigError(f"chunk_rows must be >= 1, got {self.chunk_rows}")

    @property
    def single(self) -> bool:
        return self.count == 1

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"shard {self.index} of {self.count}"

    def chunk(self, ordinal: int) -> int:
        """The chunk number of a row: its file's sequence number plus its chunk inside the file."""
        return (ordinal >> ORDINAL_BITS) + (ordinal & _INDEX_MASK) // self.chunk_rows

    def owns(self, ordinal: int) -> bool:
        return self.single or self.chunk(ordinal) % self.count == self.index

    def share(self, total: int | None, seq: int = 0) -> int | None:
        """How many of the ``total`` rows of file ``seq`` this shard owns."""
        if total is None or self.single:
            return total
        k, n = self.chunk_rows, self.count
        index = (self.index - seq) % n  # the file's chunk 0 is the job's chunk ``seq``
        full, rest = divmod(total, k)
        rows = (full // n + (index < full % n)) * k
        return rows + (rest if full % n == index else 0)

    def share_of(self, counts: Mapping[int, int | None]) -> int | None:
        """This shard's rows of files with ``{sequence number: rows}`` (None when a count is unknown)."""
        shares = [self.share(rows, seq) for seq, rows in counts.items()]
        return None if None in shares else sum(shares)  # type: ignore[arg-type]

    def filters(self, done: IntervalSet) -> tuple[Callable[[int], bool], Callable[[int, int], bool]]:
        """``(skip, covered)`` for the reader: rows done already or owned by another shard are skipped."""
        if self.single:
            return done.__contains__, done.covers
        k, n, i = self.chunk_rows, self.count, self.index

        def skip(ordinal: int) -> bool:
            return self.chunk(ordinal) % n != i or ordinal in done

        def covered(a: int, b: int) -> bool:  # [a, b) lies inside one file
            base = a & ~_INDEX_MASK
            lo, hi = a - base, b - base
            c = lo // k
            c += (i - (base >> ORDINAL_BITS) - c) % n  # the first chunk of ours at or after a's
            while c * k < hi:
                if not done.covers(base + max(lo, c * k), base + min(hi, (c + 1) * k)):
                    return False
                c += n
            return True

        return skip, covered


def choose_chunk_rows(total_rows: int | None, num_shards: int) -> int:
    """Chunk size for a new job: small enough that every shard gets many chunks, at most 1024 rows."""
    if total_rows is None:
        return MAX_CHUNK_ROWS
    return max(1, min(MAX_CHUNK_ROWS, total_rows // (num_shards * _CHUNKS_PER_SHARD)))


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not _INTEGER.fullmatch(value.strip()):
        raise ConfigError(f"environment variable {name}={value!r} is not an integer")
    return int(value)


def _within_array(given: Shard, outer: Shard | None) -> Shard:
    """Explicit shard flags inside a Slurm array task: the ``--devices`` launcher's workers get their shard
    so, a block of the task's own (array task ``a`` of ``A``, ``D`` workers each: shards ``a*D .. a*D+D-1`` of
    ``A*D``). Flags that name a shard outside this task's block (the same ``--shard-index`` in every task)
    would leave the other shards undone: refused."""
    if outer is None:
        return given
    per_task, left = divmod(given.count, outer.count)
    if left or given.index // per_task != outer.index:
        raise ConfigError(
            f"--num-shards {given.count} --shard-index {given.index} in Slurm array task {outer.index} of "
            f"{outer.count}: each array task must own its own shards (this one {outer.index} of {outer.count}, "
            "from the array alone); leave --num-shards/--shard-index out of an array job"
        )
    return given


def _inner(env: Mapping[str, str], num_shards: int | None) -> Shard | None:
    """The rank inside one job: torchrun, Slurm tasks or a Kubernetes indexed job."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Shard(_int(env, "RANK"), _int(env, "WORLD_SIZE"), "torchrun RANK/WORLD_SIZE")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") > 1:
        _check_srun_step(env)
        return Shard(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), "SLURM_PROCID/SLURM_NTASKS")
    if "JOB_COMPLETION_INDEX" in env:
        if num_shards is None:
            raise ConfigError(
                "JOB_COMPLETION_INDEX is set (a Kubernetes indexed job) but not the number of shards: give "
                "--num-shards N or set BATCHJOB_NUM_SHARDS to the job's completions"
            )
        return Shard(_int(env, "JOB_COMPLETION_INDEX"), num_shards, "JOB_COMPLETION_INDEX")
    return None


def _in_srun_step(env: Mapping[str, str]) -> bool:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return bool(_INTEGER.fullmatch(step)) and 0 <= int(step) < 0xFFFFFFF0  # batch, extern steps: higher


def _check_srun_step(env: Mapping[str, str]) -> None:
    """SLURM_PROCID/SLURM_NTASKS name this worker's task only inside a step ``srun`` started (it sets
    SLURM_STEP_ID); a batch script asking for several tasks runs once, with SLURM_PROCID 0, and would take
    shard 0 of them alone: the other shards would never run."""
    if not _in_srun_step(env):
        raise ConfigError(
            f"SLURM_NTASKS={env['SLURM_NTASKS']} but this is no srun task (no SLURM_STEP_ID): Slurm runs a batch "
            "script once, so one worker would take the first of the tasks' shares. Start batchjob with srun "
            "(a worker per task), or ask for one task (a Slurm array gives each array task its share)"
        )


def scheduler_workers(env: Mapping[str, str]) -> list[str]:
    """The scheduler variables set here that make this process one of several workers (``NAME=value``), for
    ``--ray``, which starts every shard itself: each such process would run the whole job. A batch script
    asking for several tasks is none of them (it runs once: where a Ray driver usually runs)."""

    def given(*names: str) -> list[str]:
        return [f"{n}={env[n]}" for n in names if n in env]

    found = []
    if "SLURM_ARRAY_TASK_ID" in env and env.get("SLURM_ARRAY_TASK_COUNT", "").strip() != "1":
        found += given("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
    if "WORLD_SIZE" in env and "RANK" in env and env["WORLD_SIZE"].strip() != "1":
        found += given("RANK", "WORLD_SIZE")
    if "SLURM_PROCID" in env and env.get("SLURM_NTASKS", "1").strip() != "1" and _in_srun_step(env):
        found += given("SLURM_PROCID", "SLURM_NTASKS")
    return found + given("JOB_COMPLETION_INDEX")


def _array(env: Mapping[str, str]) -> Shard | None:
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    if "SLURM_ARRAY_TASK_COUNT" not in env:
        raise ConfigError(
            f"SLURM_ARRAY_TASK_ID={env['SLURM_ARRAY_TASK_ID']!r} is set but not SLURM_ARRAY_TASK_COUNT (Slurm "
            "sets both in an array task): set SLURM_ARRAY_TASK_COUNT to the array's number of tasks, or give "
            "this task's shard as --num-shards N --shard-index I"
        )
    task, count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
    low = _int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
    step = _int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
    index, off = divmod(task - low, max(step, 1))
    if off or not 0 <= index < count:
        raise ConfigError(
            f"Slurm array task {task} is not one of {count} evenly spaced tasks from {low}: use a range "
            "such as --array=0-7 (or give --num-shards and --shard-index)"
        )
    return Shard(index, count, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")


def _readable_array(env: Mapping[str, str]) -> Shard | None:
    """The array task to check explicit flags against; None when the array variables can't say which it is
    (no SLURM_ARRAY_TASK_COUNT, an uneven array, a value that is no integer): the refusals for those ask for
    --num-shards/--shard-index, so then the flags win unchecked."""
    try:
        return _array(env)
    except ConfigError:
        return None


def detect_shard(
    env: Mapping[str, str], num_shards: int | None = None, shard_index: int | None = None
) -> Shard:
    """This worker's shard from the options (which win) or the scheduler's environment variables."""
    if shard_index is not None:
        if num_shards is None:
            raise ConfigError("--shard-index needs --num-shards (the number of workers of the job)")
        return _within_array(
            Shard(shard_index, num_shards, "--num-shards/--shard-index"), _readable_array(env)
        )
    inner, outer = _inner(env, num_shards), _array(env)
    found = outer or inner
    if outer is not None and inner is not None:
        found = Shard(
            outer.index * inner.count + inner.index,
            outer.count * inner.count,
            f"{outer.origin} x {inner.origin}",
        )
    if found is not None:
        if num_shards is not None and num_shards != found.count:
            raise ConfigError(
                f"--num-shards {num_shards} disagrees with {found.origin}, which give {found.count} shards"
            )
        return found
    if num_shards is not None and num_shards != 1:
        raise ConfigError(
            f"--num-shards {num_shards} without --shard-index, and no scheduler variables to take the "
            "index from (SLURM_ARRAY_TASK_ID, SLURM_PROCID, RANK, JOB_COMPLETION_INDEX)"
        )
    return Shard()
