"""Shard assignment: a balanced partition of every input's rows; the shard taken from each scheduler's env."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import ConfigError
from batchjob.io.readers import iter_rows
from batchjob.io.sources import discover
from batchjob.job.intervals import IntervalSet
from batchjob.job.shard import MAX_CHUNK_ROWS, Shard, choose_chunk_rows, detect_shard, scheduler_workers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def mixed_inputs(tmp_path):
    """Two Parquet files (several row groups) and two JSONL files, one gzipped: 3,000 + 1,237 + 500 + 1 rows."""
    import gzip

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"x": list(range(3000))}), folder / "a.parquet", row_group_size=700)
    pq.write_table(pa.table({"x": list(range(1237))}), folder / "b.parquet", row_group_size=1000)
    (folder / "c.jsonl").write_text("".join(json.dumps({"x": i}) + "\n" for i in range(500)))
    with gzip.open(folder / "d.jsonl.gz", "wt") as f:
        f.write('{"x": 0}\n')
    return folder


def owned_ordinals(sources, shard, done=None):
    skip, covered = shard.filters(done or IntervalSet())
    return [row.ordinal for row in iter_rows(sources, skip=skip, covered=covered)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64, MAX_CHUNK_ROWS])
def test_shards_partition_parquet_and_jsonl_rows_balanced(mixed_inputs, num_shards, chunk_rows):
    sources = discover([str(mixed_inputs)])
    assert [s.kind for s in sources] == ["parquet", "parquet", "jsonl", "jsonl"]
    counts = {0: 3000, 1: 1237, 2: 500, 3: 1}  # rows per file, by sequence number
    shares = []
    for i in range(num_shards):
        shard = Shard(i, num_shards, chunk_rows=chunk_rows)
        got = owned_ordinals(sources, shard)
        assert len(got) == shard.share_of(counts)  # the count the shard expects without reading
        shares.append(got)
    everything = sorted(o for share in shares for o in share)
    assert everything == [(seq << 40) + i for seq, n in counts.items() for i in range(n)]  # each row once
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= len(sources) * chunk_rows  # within a chunk per file
    # within one source the shards take interleaved row ranges, not whole files
    if num_shards > 1 and chunk_rows < 1000:
        owners = {Shard(0, num_shards, chunk_rows=chunk_rows).chunk(o) % num_shards for o in range(3000)}
        assert len(owners) == num_shards


def test_many_small_files_spread_over_the_shards():
    shard = Shard(0, 4, chunk_rows=1024)
    firsts = [Shard(0, 4, chunk_rows=1024).chunk(seq << 40) % 4 for seq in range(8)]
    assert firsts == [0, 1, 2, 3, 0, 1, 2, 3]  # file by file, not all on shard 0
    assert shard.share_of({seq: 10 for seq in range(8)}) == 20


def test_done_rows_and_other_shards_rows_are_skipped_without_reading(mixed_inputs):
    sources = discover([str(mixed_inputs)])
    shard = Shard(1, 3, chunk_rows=100)
    done = IntervalSet([(0, 2000)])
    skip, covered = shard.filters(done)
    assert covered(0, 2000) and covered(1900, 2200)  # done, then shard 2's and shard 0's chunks
    assert not covered(1900, 2300) and not covered(2199, 2201)  # chunk 22 is ours and not done
    b = 1 << 40  # the second file (seq 1): its chunk j is the job's chunk 1 + j
    assert not covered(b, b + 1)  # its first chunk is the job's chunk 1: ours, not done
    assert covered(b + 100, b + 300) and not covered(b + 100, b + 301)  # chunks 2 and 3 are others', 4 ours
    got = owned_ordinals(sources, shard, done)
    want = [o for o in range(2000, 3000) if (o // 100) % 3 == 1]
    for seq, n in ((1, 1237), (2, 500), (3, 1)):
        want += [(seq << 40) + i for i in range(n) if (seq + i // 100) % 3 == 1]
    assert got == want


def test_chunk_rows_adapts_to_small_jobs():
    assert choose_chunk_rows(None, 8) == MAX_CHUNK_ROWS
    assert choose_chunk_rows(10_000_000, 8) == MAX_CHUNK_ROWS
    assert choose_chunk_rows(300, 3) == 6  # 50 chunks: every shard gets 16 or 17
    assert choose_chunk_rows(5, 3) == 1


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({}, {}, (0, 1)),
        ({}, {"num_shards": 4, "shard_index": 2}, (2, 4)),
        (
            {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0"},
            {},
            (5, 8),
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "10"},
            {},
            (2, 4),
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_STEP": "2",
            },
            {},
            (2, 3),
        ),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, {}, (3, 4)),  # an srun task
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, {}, (0, 1)),  # a plain sbatch: one task
        ({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, {}, (5, 16)),
        # torchrun under srun: torchrun's global rank, not srun's task id
        ({"RANK": "5", "WORLD_SIZE": "16", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, {}, (5, 16)),
        ({"JOB_COMPLETION_INDEX": "6"}, {"num_shards": 10}, (6, 10)),
        # an array of 3 tasks, each with 4 srun tasks: 12 shards
        (
            {
                "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "4",
                "SLURM_STEP_ID": "2",
            },
            {},
            (9, 12),
        ),
        # explicit flags win over the environment; in an array task, one of its own block (--devices' workers)
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
            {"num_shards": 4, "shard_index": 3},
            (3, 4),
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"},
            {"num_shards": 3, "shard_index": 2},
            (2, 3),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, {"num_shards": 2}, (1, 2)),
        # an array task its variables can't place: the flags its refusal asks for win
        ({"SLURM_ARRAY_TASK_ID": "2"}, {"num_shards": 4, "shard_index": 2}, (2, 4)),
        (
            {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1"},
            {"num_shards": 3, "shard_index": 2},
            (2, 3),
        ),
    ],
)
def test_detect_shard_from_each_scheduler(env, flags, expected):
    shard = detect_shard(env, **flags)
    assert (shard.index, shard.count) == expected


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({}, {"shard_index": 1}, "--shard-index needs --num-shards"),
        # the same explicit index in every array task: the other shards would never run
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
            {"num_shards": 2, "shard_index": 0},
            "in Slurm array task 1 of 2: each array task must own its own shards",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
            {"num_shards": 3, "shard_index": 2},
            "leave --num-shards/--shard-index out of an array job",
        ),
        # a batch script asking for several tasks runs once: it is no task of them
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, {}, "this is no srun task"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "4294967294"},
            {},
            "Start batchjob with srun",
        ),
        (  # a step id that is no integer is no srun step (it was a ValueError traceback)
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "\u00b2"},
            {},
            "Start batchjob with srun",
        ),
        ({}, {"num_shards": 3, "shard_index": 3}, "shard_index must be in 0..2"),
        ({}, {"num_shards": 3}, "without --shard-index"),
        ({"JOB_COMPLETION_INDEX": "2"}, {}, "BATCHJOB_NUM_SHARDS"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x' is not an integer"),
        ({"SLURM_ARRAY_TASK_ID": "1_0", "SLURM_ARRAY_TASK_COUNT": "12"}, {}, "'1_0' is not an integer"),
        ({"SLURM_ARRAY_TASK_ID": "--1", "SLURM_ARRAY_TASK_COUNT": "4"}, {}, "'--1' is not an integer"),
        ({"SLURM_ARRAY_TASK_ID": "\u00b2", "SLURM_ARRAY_TASK_COUNT": "4"}, {}, "'\u00b2' is not an integer"),
        (
            {"SLURM_ARRAY_TASK_ID": "2"},
            {"num_shards": 4},
            "not SLURM_ARRAY_TASK_COUNT .* --num-shards N --shard-index I",
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, {"num_shards": 3}, "disagrees with torchrun"),
        (
            {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1"},
            {},
            "--array",
        ),
    ],
)
def test_detect_shard_mistakes_name_the_problem(env, flags, message):
    with pytest.raises(ConfigError, match=message):
        detect_shard(env, **flags)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"},
            "SLURM_ARRAY_TASK_ID=3 SLURM_ARRAY_TASK_COUNT=4",
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1 WORLD_SIZE=2"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "SLURM_PROCID=1 SLURM_NTASKS=2"),
        ({"JOB_COMPLETION_INDEX": "0"}, "JOB_COMPLETION_INDEX=0"),
    ],
)
def test_ray_in_a_scheduler_worker_is_refused_naming_its_variables(
    env, named, tiny_model_dir, tmp_path, monkeypatch
):
    """--ray starts every shard itself: in each task of an array (or rank of torchrun...) it would run the
    whole job again. Refused before Ray is imported, naming the variables."""
    from click.testing import CliRunner

    from batchjob.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "a"}\n')
    args = ["run", "--ray", "--input", data, "--output", tmp_path / "out", "--model", tiny_model_dir]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 2 and f"but {named} make this process one of several" in result.output
    assert not (tmp_path / "out").exists()


def test_scheduler_workers_leaves_one_worker_alone():
    # a batch script asking for several tasks runs once (a Ray driver's usual place); one task; torchrun of 1
    assert scheduler_workers({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "4294967294"}) == []
    assert scheduler_workers({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}) == []
    assert scheduler_workers({"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == []
