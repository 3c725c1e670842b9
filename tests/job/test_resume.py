"""Crash tests: SIGKILL a real ``batchjob run`` at random moments, resume, compare with an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from batchjob.job import make_spec, run_job
from tests.jobproc import read_results as results
from tests.jobproc import run_here

pytestmark = pytest.mark.timeout(300)

# Enough rows that a job runs for seconds after its first commit: a SIGTERM then finds rows in flight. (The
# kills fall before a job's first commit is passed, so more rows would only lengthen the runs.)
N_ROWS = 100


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "reviews.jsonl"
    rng = random.Random(0)
    words = [
        "great",
        "terrible",
        "fine",
        "broke",
        "love",
        "quality",
        "price",
        "arrived",
        "quickly",
        "slow",
        "cheap",
        "sturdy",
    ]
    with open(path, "w") as f:
        for i in range(N_ROWS):
            f.write(
                json.dumps({"rid": f"r{i}", "review": " ".join(rng.choices(words, k=rng.randint(3, 30)))})
                + "\n"
            )
        f.write("{torn json\n")
    return path


def job_args(reviews, out, model, *extra):
    return [
        "--input",
        str(reviews),
        "--output",
        str(out),
        "--model",
        str(model),
        "--template",
        "Review: {review}\nSentiment:",
        "--id-column",
        "rid",
        "--max-new-tokens",
        "12",
        "--max-num-seqs",
        "8",
        "--checkpoint-interval",
        "0.2",
        *extra,
    ]


def wait_started(out, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not (out / "_batchjob" / "job.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1", "--seed", "7"]], ids=["greedy", "seeded"])
def test_sigkill_any_number_of_times_then_resume_equals_uninterrupted(
    launch, reviews, tiny_model_dir, tmp_path, sampling
):
    ref = tmp_path / "ref"
    spec = dict(
        input=[str(reviews)],
        output=str(ref),
        model=str(tiny_model_dir),
        template="Review: {review}\nSentiment:",
        id_column="rid",
        max_new_tokens=12,
        max_num_seqs=8,
    )
    if sampling:
        spec.update(temperature=1.0, seed=7)
    assert run_job(make_spec(**spec)).status == "complete"
    expected = results(ref)
    assert len(expected) == N_ROWS + 1

    out = tmp_path / "out"
    rng = random.Random(hash(tuple(sampling)) & 0xFFFF)
    # Each run is SIGKILLed at a random moment; it also stops at its first committed part (a fault point) and
    # waits there, so it can never finish before the kill, however fast the machine: the kill falls anywhere
    # from loading the model to just after a commit.
    for _ in range(3):
        proc = launch(
            job_args(reviews, out, tiny_model_dir, *sampling), BATCHJOB_FAULT_PAUSE="part_committed"
        )
        wait_started(out, proc)
        time.sleep(rng.uniform(0.0, 1.2))
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # the resume, in this process: what the killed processes left on disk is the point
    code, output = run_here(job_args(reviews, out, tiny_model_dir, *sampling))
    assert code == 0, output
    got = results(out)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]  # every row exactly once
    assert got == expected
    assert any(r["error"] and f"line {N_ROWS + 1}" in r["error"] for r in got)
    # a resume after completion says so and does nothing
    code, text = run_here(job_args(reviews, out, tiny_model_dir, *sampling))
    assert code == 0 and "already complete" in text


def test_sigterm_saves_state_exits_75_and_resumes_exactly(launch, reviews, tiny_model_dir, tmp_path):
    # Steps of 512 tokens (not the CPU's 2,048 for this model): a step then admits a few rows at a time, so
    # rows are mid-generation when the first rows are committed.
    args = ["--temperature", "0.8", "--seed", "3", "--checkpoint-interval", "0.3"]
    args += ["--max-num-batched-tokens", "512"]
    ref = tmp_path / "ref"
    assert (
        run_job(
            make_spec(
                input=[str(reviews)],
                output=str(ref),
                model=str(tiny_model_dir),
                template="Review: {review}\nSentiment:",
                id_column="rid",
                max_new_tokens=12,
                temperature=0.8,
                seed=3,
                max_num_batched_tokens=512,
            )
        ).status
        == "complete"
    )
    out = tmp_path / "out"
    proc = launch(job_args(reviews, out, tiny_model_dir, *args))
    wait_started(out, proc)
    while not (out / "_batchjob" / "manifest.jsonl").exists():  # the first rows are committed
        assert proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, text
    assert "Traceback" not in text and "resume" in text
    inflight = json.loads((out / "_batchjob" / "inflight.json").read_text())["body"]["requests"]
    assert inflight and any(r["output_ids"] for r in inflight)  # it stopped mid-generation
    done = len(results(out))
    assert 0 < done < N_ROWS + 1
    code, text = run_here(job_args(reviews, out, tiny_model_dir, *args))  # the resume, in this process
    assert code == 0, text
    assert results(out) == results(ref)
