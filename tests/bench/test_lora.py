"""``batchjob bench --adapters``: random adapters on a tiny model, ours against PEFT's mixed batch and merged
adapters one after another; in float64 every engine's greedy tokens agree, and the adapters change them."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from batchjob.cli import main

pytest.importorskip("peft")

SMALL = ["--num-requests", "5", "--prompt-len", "8,24", "--output-len", "2,6", "--device", "cpu"]


@pytest.mark.timeout(240)
def test_adapters_workload_table_and_json(tiny_model_dir, tmp_path):
    out = tmp_path / "lora.json"
    args = ["bench", "--model", str(tiny_model_dir), *SMALL, "--static-batch-size", "2", "--threads", "1"]
    args += ["--adapters", "1,3", "--lora-ranks", "4,8", "--dtype", "float64", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    text = result.output
    assert re.search(r"base model alone: ours [\d.]+ tok/s, static generate [\d.]+ tok/s", text)
    assert "random A and B on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj," in text
    header = next(line for line in text.splitlines() if line.split()[:2] == ["adapters", "rank"])
    assert "ours/peft" in header and "ours/merged" in header and "agree peft" in header
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\s+[\d.]+\s", line)]
    # One row per (count, rank), ranks outer; float64: every row agrees with PEFT and with the merged model,
    # and the random adapters changed every request (so agreement is not the base model's tokens twice).
    assert [(r[0], r[1]) for r in rows] == [("1", "4"), ("3", "4"), ("1", "8"), ("3", "8")]
    for r in rows:
        assert r[3].endswith("x") and r[5].endswith("x") and r[7].endswith("x")
        assert r[8:] == ["5/5", "5/5", "5/5"], r

    body = json.loads(out.read_text())
    assert body["dtype"] == "float64" and body["workload"]["num_requests"] == 5
    total_out = body["workload"]["output_tokens"]
    assert body["base"]["ours"]["output_tokens"] == total_out
    assert [(c["adapters"], c["rank"]) for c in body["cells"]] == [(1, 4), (3, 4), (1, 8), (3, 8)]
    for cell in body["cells"]:
        assert cell["agreement"] == {"peft": {"equal": 5, "total": 5}, "merged": {"equal": 5, "total": 5}}
        assert cell["changed_from_base"] == 5
        for name, r in cell["results"].items():
            assert r["error"] is None and r["wall_s"] > 0, name
            assert r["output_tokens"] == total_out
        assert cell["results"]["ours"]["extra"]["steps"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--adapters", "0"], "--adapters"),
        (["--adapters", "2,x"], "--adapters"),
        (["--adapters", "2", "--lora-ranks", "0"], "--lora-ranks"),
        (["--adapters", "2", "--task", "embed"], "--task embed"),
    ],
)
def test_bad_adapters_options_exit_2(extra, message):
    result = CliRunner().invoke(main, ["bench", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(240)
def test_a_run_of_ours_with_failed_requests_prints_no_figure(tiny_model_dir):
    """4 of 6 requests failed (a pool too small for them) and the table printed ours' tok/s and its ratios
    all the same, over the rows that ran: the bench stops instead, naming the failure."""
    args = ["bench", "--model", str(tiny_model_dir), *SMALL, "--threads", "1", "--adapters", "1"]
    args += ["--num-blocks", "4", "--block-size", "4", "--prompt-len", "10,40"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "ours failed with the base model alone: " in result.output and "request(s) failed" in result.output
    assert "tok/s" not in result.output and "Traceback" not in result.output
