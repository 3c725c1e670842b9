"""The job files in ``jobs/`` are there to be copied: each validates as shipped on the embedded default model,
and the task one runs."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main

JOBS = Path(__file__).resolve().parents[2] / "jobs"
NEEDS_A_VLM = {"images.toml"}  # validated with a tiny LLaVA by --model in tests/job/test_images.py


@pytest.mark.engine  # the default model's config and tokenizer, from its cache
@pytest.mark.parametrize(
    "path", sorted(p for p in JOBS.glob("*.toml") if p.name not in NEEDS_A_VLM), ids=lambda p: p.name
)
def test_each_job_file_validates(path, tmp_path):
    extra = []
    if path.name == "lora.toml":  # its adapters, as its comment says to build them (validate reads them)
        build = runpy.run_path(str(JOBS.parent / "examples" / "make_lora_adapters.py"))["build"]
        extra = [f"--lora={name}={folder}" for name, folder in build(tmp_path / "adapters").items()]
    result = CliRunner().invoke(main, ["validate", str(path), "--output", str(tmp_path / "out"), *extra])
    assert result.exit_code == 0, result.output
    assert "ok: 1 input file(s)" in result.output, result.output
    if path.name == "lora.toml":  # not built: refused by name, as the run would at load
        result = CliRunner().invoke(main, ["validate", str(path), "--lora", f"formal={tmp_path / 'none'}"])
        assert result.exit_code == 2 and "LoRA adapter 'formal'" in result.output, result.output


@pytest.mark.engine  # runs the default model
def test_the_perplexity_job_scores_every_review(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(JOBS / "perplexity.toml"), "--output", str(out)])
    assert result.exit_code == 0, result.output
    rows = pq.ParquetDataset(str(out)).read().to_pylist()
    assert len(rows) == 200 and all(r["error"] is None for r in rows)
    for r in rows:
        # every token of the review but the first is scored; perplexity is exp of minus their mean
        assert r["num_scored_tokens"] == r["num_prompt_tokens"] - 1 > 0
        assert r["logprob"] < 0
        assert math.isclose(r["perplexity"], math.exp(-r["logprob"] / r["num_scored_tokens"]), rel_tol=1e-12)
