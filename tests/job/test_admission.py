"""Admission policies and prefix caching through the job runner: same results, different schedules."""

from __future__ import annotations

import json
import random

import pyarrow.dataset as ds
import pytest

from batchjob.io.atomic import read_json
from batchjob.job import make_spec, run_job

pytestmark = pytest.mark.timeout(240)


def _rows(n: int) -> list[dict]:
    rng = random.Random(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "and",
        "then",
        "some",
        "more",
        "words",
        "follow",
    ]
    return [{"id": f"r{i}", "text": " ".join(rng.choices(words, k=rng.randint(1, 60)))} for i in range(n)]


def _run(tmp_path, model, name, **options):
    src = tmp_path / "in.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps(r) + "\n" for r in _rows(40)))
    out = tmp_path / name
    spec = make_spec(
        input=[str(src)],
        output=str(out),
        model=str(model),
        id_column="id",
        max_new_tokens=6,
        system="You label things. Answer in one word please, and be brief about it.",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        **options,
    )
    result = run_job(spec)
    assert result.status == "complete"
    table = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    stats = read_json(out / "_batchjob" / "stats.json")
    return {r["id"]: (r["generated_text"], r["num_generated_tokens"]) for r in table}, len(table), stats


def test_every_policy_gives_the_same_rows(tmp_path, tiny_model_dir):
    base, n, stats = _run(tmp_path, tiny_model_dir, "fcfs")
    assert n == 40 and len(base) == 40
    # the shared system prompt is computed once and then served from the prefix cache
    assert stats["engine"]["cached_prompt_tokens"] > 0 and "preemptions" in stats["engine"]
    for policy in ("longest-first", "shortest-first", "static"):
        rows, n, _ = _run(tmp_path, tiny_model_dir, policy, admission=policy, lookahead=16)
        assert n == 40 and rows == base, policy


def test_prefix_caching_off_gives_the_same_rows(tmp_path, tiny_model_dir):
    on, _, stats_on = _run(tmp_path, tiny_model_dir, "on")
    off, _, stats_off = _run(tmp_path, tiny_model_dir, "off", prefix_caching=False)
    assert on == off

    assert stats_on["engine"]["cached_prompt_tokens"] > 0
    assert stats_off["engine"]["cached_prompt_tokens"] == 0
    assert stats_on["engine"]["computed_prompt_tokens"] < stats_off["engine"]["computed_prompt_tokens"]
