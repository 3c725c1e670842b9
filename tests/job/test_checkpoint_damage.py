"""A damaged in-flight checkpoint costs only recomputation: it is set aside, its requests start again from their
prompts, and the job's results are still exactly an uninterrupted run's. Other damaged state files are
reported with advice that keeps the finished parts."""

from __future__ import annotations

import json
import shutil

import pytest

from batchjob.errors import StateError
from batchjob.io.atomic import read_json, write_json
from tests.faultproc import job_args, reference, write_reviews
from tests.jobproc import launch as start_process
from tests.jobproc import read_results as results
from tests.jobproc import run_here
from tests.tiers import process_fixture

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    return write_reviews(tmp_path_factory.mktemp("data") / "reviews.jsonl", 15)


@pytest.fixture(scope="module")
def expected(reviews, tiny_model_dir, tmp_path_factory):
    return reference(reviews, tiny_model_dir, tmp_path_factory.mktemp("ref") / "out")


def args(reviews, out, model):
    return job_args(reviews, out, model, "--checkpoint-interval", "0.001")


@process_fixture(scope="module")
def interrupted(reviews, tiny_model_dir, tmp_path_factory):
    """The output folder of an interrupted job: parts committed, requests in flight (stopped by a full disk at
    its third part). Run once; each damage is done to a copy of it."""
    out = tmp_path_factory.mktemp("interrupted") / "out"
    first = start_process(args(reviews, out, tiny_model_dir), BATCHJOB_FAULT_ENOSPC="part:3")
    text = first.communicate(timeout=240)[0]
    first.stdout.close()
    assert first.returncode == 1, text
    requests = read_json(out / "_batchjob" / "inflight.json")["requests"]
    assert requests and any(r["output_ids"] for r in requests)  # mid-generation: something to lose
    return out


def torn(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def altered(path):  # valid JSON whose checksum no longer matches
    doc = json.loads(path.read_text())
    doc["body"]["requests"][0]["output_ids"].append(7)
    path.write_text(json.dumps(doc))


def malformed(path):  # a sound file whose body is not a checkpoint
    write_json(path, {"requests": [{"id": "r00"}]})


@pytest.mark.parametrize("damage", [torn, altered, malformed])
def test_a_damaged_checkpoint_is_set_aside_and_the_job_ends_exact(
    interrupted, reviews, tiny_model_dir, tmp_path, expected, damage
):
    out = tmp_path / "out"
    shutil.copytree(interrupted, out)
    checkpoint = out / "_batchjob" / "inflight.json"
    damage(checkpoint)
    damaged = checkpoint.read_bytes()

    code, text = run_here(args(reviews, out, tiny_model_dir))  # the resume: what is on disk is the point
    assert code == 0, text
    assert f"batchjob: warning: checkpoint {checkpoint} " in text
    assert "start again from their prompts" in text and "delete" not in text
    assert results(out) == expected  # every row exactly once, the same text
    (aside,) = (out / "_batchjob").glob("inflight.json.corrupt-*")
    assert aside.read_bytes() == damaged  # kept for a look, where Parquet readers do not go


def test_other_damaged_state_says_how_to_keep_the_work(tmp_path):
    job = tmp_path / "job.json"
    write_json(job, {"a": 1})
    job.write_bytes(job.read_bytes()[:20])
    with pytest.raises(StateError) as e:
        read_json(job)
    message = str(e.value)
    assert f"state file {job} is torn" in message
    assert "restore it from a backup" in message and "new --output" in message and "keep them" in message
    assert "delete" not in message
