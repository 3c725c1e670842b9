"""``batchjob bench`` on a tiny model: three engines, ratios, the JSON file, and bad options exiting 2."""

from __future__ import annotations

import json
import random
import re

import pytest
from click.testing import CliRunner

from batchjob.bench.workload import log_uniform_lengths, synthetic_workload
from batchjob.cli import main

SMALL = ["--num-requests", "3", "--prompt-len", "8,24", "--output-len", "2,5", "--device", "cpu"]


@pytest.mark.timeout(120)
def test_bench_runs_three_engines_and_writes_json(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model_dir), *SMALL, "--static-batch-size", "2", "--threads", "1"]
    args += ["--hf-cb-max-batch-tokens", "32,64", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    text = result.output
    for label in ("ours max_num_batched_tokens=", "static batch_size=2", "hf-cb max_batch_tokens=32"):
        assert label in text
    assert "hf-cb max_batch_tokens=64" in text
    assert "ratio ours/hf-cb" in text and "ratio ours/static" in text
    assert "our time:" in text and "forward" in text
    assert "agreement: ours == static greedy tokens on" in text
    assert re.search(
        r"roofline: prefill (\d+%|\?) of [\d.]+ [kGMT]?FLOP/s, decode (\d+%|\?) of [\d.]+ [kGMT]?B/s \(KV \d+% of the bytes\) and (\d+%|\?) of peak FLOP/s at \d+ rows a step; end to end (\d+%|\?) \(the limits allow [\d.]+ s of [\d.]+ s\) \(cpu",
        text,
    )

    body = json.loads(out.read_text())
    roof = body["roofline"]
    assert roof["peak_flops_per_s"] > 0 and roof["weight_bandwidth_bytes_per_s"] > 0
    assert roof["features"].startswith("cpu:") and roof["prefill_seconds"] > 0
    assert roof["shape"]["body_params"] > 0 and roof["decode_steps"] > 0
    assert body["workload"]["num_requests"] == 3
    assert body["workload"]["seed"] == 0
    assert body["options"]["hf_cb_max_batch_tokens"] == [32, 64] and body["options"]["static_batch_size"] == 2
    assert body["torch_threads"] == 1
    cb = [r for r in body["results"] if r["name"] == "hf-cb"]
    assert [r["settings"]["max_batch_tokens"] for r in cb] == [32, 64]
    assert all(isinstance(r["settings"]["num_blocks"], int) for r in cb)  # sized to the workload
    assert set(body["versions"]) == {"batchjob", "torch", "transformers"}
    names = [r["name"] for r in body["results"]]
    assert names == ["ours", "static", "hf-cb", "hf-cb"]
    total_out = body["workload"]["output_tokens"]
    for r in body["results"]:
        assert r["error"] is None
        assert r["output_tokens"] == total_out  # every engine did the same work
        assert r["wall_s"] > 0 and r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > 0
    ours = body["results"][0]["extra"]
    assert 0 < ours["forward_seconds"] <= ours["step_seconds"]
    assert 0 <= ours["overhead_fraction"] < 1
    # the KV memory the run holds is the blocks it wrote, a sliver of the pool's budget (the most the
    # engine's seats can use: 64 requests of the model's whole context here)
    assert ours["kv_mib"] < ours["kv_budget_mib"] / 10
    assert re.search(r"KV cache \d+ MiB \(of a \d+ MiB budget\)", text), text
    assert set(body["ratios"]) == {"ours/hf-cb", "ours/static"}
    # Greedy in fp32 on the ordinary tiny model: every engine picks the same tokens (no near-tie on these).
    assert body["agreement"]["static"] == {"equal": 3, "total": 3}
    assert body["agreement"]["hf-cb"] == {"equal": 3, "total": 3}


@pytest.mark.timeout(60)
def test_bench_dataset_and_subset_of_baselines(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    long = {"text": "Paris is the capital " * 40}  # over the context of 64 tokens less 3 of output
    rows = [
        {"text": "The quick brown fox."},
        {"other": 1},
        "not a dict",
        {"prompt": "Paris is the capital"},
        long,
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    args = ["bench", "--model", str(tiny_model_dir), "--dataset", str(data), "--output-len", "3"]
    args += ["--baselines", "ours,static", "--device", "cpu", "--worker-thread", "--no-roofline"]
    result = CliRunner().invoke(main, [*args, "--max-model-len", "64", "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert "roofline" not in result.output  # neither measured nor reported
    assert f"3 requests ({data})" in result.output
    # what the figures leave out, said once (they were cut, skipped and short of --num-requests silently)
    note = (
        f"--dataset {data}: 3 requests of the 64 asked for (--num-requests): no more usable rows; "
        "1 prompt cut to the first 61 tokens (the model's context less --output-len's most); "
        "3 rows skipped (1 no non-empty 'prompt' or 'text', 1 not an object, 1 not JSON)"
    )
    assert result.output.count(note) == 1, result.output
    assert json.loads((tmp_path / "b.json").read_text())["workload"]["note"] == note
    assert "hf-cb" not in result.output
    assert "ratio ours/static" in result.output
    # an output as long as the context leaves no prompt: each was cut by a negative length, from its end
    result = CliRunner().invoke(main, [*args, "--max-model-len", "64", "--output-len", "2,64"])
    assert result.exit_code == 2, result.output
    assert "--output-len max 64 leaves no room for a --dataset prompt" in result.output


@pytest.mark.timeout(120)
def test_repeat_reports_the_fastest_of_fresh_runs(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model_dir), "--num-requests", "3", "--prompt-len", "40,60"]
    args += ["--output-len", "2,5", "--device", "cpu", "--baselines", "ours,static", "--repeat", "2"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "(run 2 of 2)" in result.output and "fastest of" in result.output
    body = json.loads(out.read_text())
    assert [r["name"] for r in body["results"]] == ["ours", "static"]
    for r in body["results"]:
        assert len(r["walls"]) == 2 and r["wall_s"] == min(r["walls"])
    # Whichever run was fastest computed every prompt token: the prefix cache was emptied before each run.
    ours = body["results"][0]["extra"]
    assert ours["batched_tokens"] >= body["workload"]["prompt_tokens"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-len", "50,10"], "--prompt-len"),
        (["--output-len", "x"], "--output-len"),
        (["--baselines", "ours,vllm"], "--baselines"),
        (["--hf-cb-max-batch-tokens", "0"], "--hf-cb-max-batch-tokens"),
        (["--num-requests", "0"], "--num-requests"),
        (["--static-batch-size", "-1"], "--static-batch-size"),
        (["--threads", "0"], "--threads"),
        (["--hf-cb-num-blocks", "lots"], "--hf-cb-num-blocks"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_option_exits_2(extra, message):
    result = CliRunner().invoke(main, ["bench", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
def test_bad_model_or_context_exits_2(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(main, ["bench", "--model", str(tmp_path / "missing"), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "missing" in result.output and "Traceback" not in result.output
    too_long = ["bench", "--model", str(tiny_model_dir), "--prompt-len", "900,1000", "--device", "cpu"]
    result = CliRunner().invoke(main, too_long)
    assert result.exit_code == 2, result.output
    assert "context of 1024 tokens" in result.output


def test_synthetic_workload_is_seeded_and_skewed_short():
    a = synthetic_workload(1000, 50, (24, 600), (8, 100), seed=3)
    b = synthetic_workload(1000, 50, (24, 600), (8, 100), seed=3)
    assert a.prompts == b.prompts and a.max_new_tokens == b.max_new_tokens
    assert all(24 <= len(p) <= 600 for p in a.prompts)
    assert all(8 <= n <= 100 for n in a.max_new_tokens)
    lengths = log_uniform_lengths(random.Random(0), 2000, 24, 600)
    assert sorted(lengths)[1000] < (24 + 600) / 2  # the median sits well below the midpoint


def test_llama_cpp_shapes_and_precisions():
    from batchjob.bench import llama_cpp
    from batchjob.errors import ConfigError

    equal = synthetic_workload(100, 4, (8, 8), (3, 3), seed=1)
    mixed = synthetic_workload(100, 4, (8, 30), (3, 3), seed=1)
    assert llama_cpp.equal_shape(equal) == (8, 3)
    assert llama_cpp.equal_shape(mixed) is None
    assert llama_cpp.gguf_type("float32") == "f32" and llama_cpp.gguf_type("bfloat16") == "bf16"
    with pytest.raises(ConfigError, match="float64 has no GGUF twin"):
        llama_cpp.gguf_type("float64")


@pytest.mark.timeout(120)
def test_bench_without_llama_cpp_says_how_to_build_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_LLAMA_CPP", str(tmp_path))  # a folder without the programs
    args = [
        "bench",
        "--model",
        str(tiny_model_dir),
        *SMALL,
        "--baselines",
        "ours,llama.cpp",
        "--threads",
        "1",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "llama.cpp not found: build it once with `bash examples/peers/llama_cpp.sh`" in result.output
    assert "ours max_num_batched_tokens=" in result.output and "ratio" not in result.output


@pytest.mark.process  # the real llama.cpp server and benches, and our engine on the default model
@pytest.mark.timeout(900)
def test_bench_against_llama_cpp_on_the_default_model(tmp_path):
    """The real llama.cpp (built by examples/peers/llama_cpp.sh) on the embedded SmolLM2, float32 both: the
    server on a mixed workload returns its tokens, and at an equal shape llama-batched-bench runs too."""
    from batchjob.bench import llama_cpp

    if llama_cpp.bin_dir() is None:
        pytest.skip(llama_cpp.BUILD_HINT)
    out = tmp_path / "bench.json"
    args = ["bench", "--num-requests", "4", "--prompt-len", "16", "--output-len", "6", "--device", "cpu"]
    args += ["--dtype", "float32", "--baselines", "ours,llama.cpp", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    by = {r["settings"].get("program", r["name"]): r for r in body["results"]}
    assert set(by) == {"ours", "server", "batched-bench"}
    assert all(r["error"] is None and r["wall_s"] > 0 for r in by.values())
    assert "ours/llama.cpp" in body["ratios"]
    # Greedy, float32 both, EOS ignored: most requests agree token for token (llama.cpp's ignore_eos also
    # bans EOS, ours lets it be picked and goes on, so a request whose argmax is EOS parts there).
    assert body["agreement"]["llama.cpp"]["total"] == 4
    # Memory: llama.cpp's own peak RSS (its process, reaped by us) holds at least its F32 weights (~540 MB);
    # its KV cache is its context of f32 K and V; ours reports its pool.
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32
    for r in (by["server"], by["batched-bench"]):
        assert r["extra"]["peak_rss_mib"] > 500, r["extra"]
        assert r["extra"]["kv_mib"] == round(4 * 256 * per_token / 2**20, 1)  # 4 slots of 256 tokens
    ours = by["ours"]["extra"]
    assert 2000 < ours["kv_budget_mib"] <= 2048  # the CPU default, --kv-memory-gb 2
    # what the pool holds: the blocks the run wrote, at least its longest request's (4 at a time, 16 tokens each)
    assert 0 < ours["kv_mib"] < 100 and ours["kv_mib"] * 2**20 >= per_token * 16
    assert "memory: " in result.output


def test_agreement_is_counted_against_a_baseline_setting_that_gave_tokens_back():
    """On a loaded machine llama-batched-bench (no tokens printed) can beat llama-server: the ratio takes the
    fastest setting, the agreement the fastest one with tokens."""
    from batchjob.bench.command import summarize
    from batchjob.bench.engines import Result

    ours = Result("ours", {}, 1.0, 8, 4, [[1, 2], [3, 4]])
    server = Result("llama.cpp", {"program": "server"}, 2.0, 8, 4, [[1, 2], [3, 5]])
    batched = Result("llama.cpp", {"program": "batched-bench"}, 0.5, 8, 4, [])
    summary = summarize([ours, server, batched])
    assert summary["ratios"]["ours/llama.cpp"] == 0.5
    assert summary["agreement"]["llama.cpp"]["total"] == 2 and summary["agreement"]["llama.cpp"]["equal"] == 1


def test_roofline_arithmetic():
    """Prefill: 2 FLOPs per weight per prompt token, the head once per request, causal attention 2 x L^2 x
    query_dim per layer; decode: every weight read once per decode step, over the run's time less prefill's."""
    from dataclasses import replace

    from batchjob.bench.roofline import (
        Limits,
        Shape,
        cpu_features,
        decode_kv_tokens,
        faster,
        format_line,
        prefill_flops,
        shares,
    )

    shape = Shape(body_params=1000, head_params=100, weight_bytes=4400, layers=2, query_dim=8)
    assert prefill_flops(shape, [3, 5]) == 2 * 1000 * 8 + 2 * 100 * 2 + 2 * 2 * 8 * (9 + 25)
    limits = Limits(
        peak_flops=17488.0, bandwidth=11000.0, gemm_tokens=8, gemm_shape=(4, 8), features="cpu: avx2"
    )
    run = {"forward_seconds": 5.0, "steps": 10, "batched_tokens": 24}
    figures = shares(shape, limits, [3, 5], run, {"forward_seconds": 2.0, "steps": 2, "batched_tokens": 8})
    assert figures["prefill_share"] == 0.5
    # a prefill pass that computed half the prompt tokens (shared prefixes from the cache) did half the FLOPs
    half = shares(shape, limits, [3, 5], run, {"forward_seconds": 2.0, "steps": 2, "batched_tokens": 4})
    assert half["prefill_flops"] == 0.5 * (2 * 1000 * 8 + 2 * 2 * 8 * (9 + 25)) + 2 * 100 * 2
    assert figures["decode_steps"] == 8 and figures["decode_weight_bytes"] == 8 * 4400
    assert figures["decode_seconds"] == 3.0 and figures["decode_share"] == 8 * 4400 / (11000 * 3.0)
    assert figures["decode_tokens"] == 16 and figures["decode_flops"] == 2 * 1100 * 16
    assert figures["decode_flops_share"] == 2 * 1100 * 16 / (17488.0 * 3.0)
    # end to end: prefill at the peak (1 s) and decode at its binding limit, here the bandwidth (3.2 s)
    assert figures["bound_seconds"] == pytest.approx(4.2) and figures["end_to_end_share"] == pytest.approx(
        0.84
    )
    assert format_line(figures) == (
        "roofline: prefill 50% of 17.5 kFLOP/s, decode 107% of 11.0 kB/s and 67% of peak FLOP/s at 2 rows a step; "
        "end to end 84% (the limits allow 4.2 s of 5.0 s) (cpu: avx2)"
    )
    # a decode time that noise sank to zero or below has no share
    again = Limits(peak_flops=1.0, bandwidth=22000.0, gemm_tokens=8, gemm_shape=(4, 8), features="cpu: avx2")
    best = faster(limits, again)
    assert (best.peak_flops, best.bandwidth) == (17488.0, 22000.0)  # each limit's higher measurement
    sunk = shares(
        shape,
        limits,
        [3, 5],
        {"forward_seconds": 1.9, "steps": 2, "batched_tokens": 8},
        {"forward_seconds": 2.0, "steps": 2, "batched_tokens": 8},
    )
    assert sunk["decode_share"] is None and "decode ? of" in format_line(sunk)
    flags = "fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
    assert cpu_features(flags) == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"]
    assert cpu_features("fpu sse2") == []
    # with each request's output length the decode rows' KV reads count too: prompts of 3 and 5 tokens,
    # 4 and 1 outputs: the first request's tokens 2-4 read 3 + 1, 3 + 2, 3 + 3 keys; the second's none
    assert decode_kv_tokens([3, 5], [4, 1]) == 15
    kv = replace(shape, kv_bytes_per_token=100)
    run, pre = (
        {"forward_seconds": 5.0, "steps": 10, "batched_tokens": 24},
        {"forward_seconds": 2.0, "steps": 2, "batched_tokens": 8},
    )
    long = shares(kv, limits, [3, 5], run, pre, [4, 1])
    assert long["decode_kv_bytes"] == 1500 and long["decode_weight_bytes"] == 8 * 4400
    assert long["decode_share"] == (8 * 4400 + 1500) / (11000 * 3.0)
    assert "decode 111% of 11.0 kB/s (KV 4% of the bytes) and 67% of peak" in format_line(long)


@pytest.mark.timeout(60)
def test_roofline_counts_the_model_linears_and_measures_its_limits(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from batchjob.bench.roofline import measure_limits, model_shape

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shape = model_shape(model)
    c = model.config
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    assert shape.head_params == head.weight.numel() == c.vocab_size * c.hidden_size
    assert shape.body_params == sum(m.weight.numel() for m in linears if m is not head)
    assert shape.weight_bytes == 4 * (shape.body_params + shape.head_params)
    assert shape.layers == c.num_hidden_layers and shape.query_dim == c.num_attention_heads * c.head_dim
    assert shape.kv_bytes_per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    limits = measure_limits(model, "cpu", torch.float32, 16)
    assert limits.peak_flops > 0 and limits.bandwidth > 0 and limits.features.startswith("cpu")
    biggest = max((m for m in linears if m is not head), key=lambda m: m.weight.numel())
    assert limits.gemm_shape == (biggest.in_features, biggest.out_features)  # not the output head


def test_the_roofline_is_left_out_where_weights_are_not_linears(tiny_model_dirs, tmp_path):
    """GPT-2's Conv1D and fused MoE experts are no nn.Linear: the roofline counted 0 of GPT-2's body and a
    fifth of Mixtral's active weights, and printed shares of that."""
    from transformers import AutoModelForCausalLM

    from batchjob.bench.roofline import uncounted
    from tests.tiny_models import make_family_model

    assert uncounted(AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])) is None
    assert "(Conv1D)" in uncounted(AutoModelForCausalLM.from_pretrained(tiny_model_dirs["gpt2"]))
    mixtral = AutoModelForCausalLM.from_pretrained(make_family_model(tmp_path / "m", "mixtral"))
    assert "MixtralExperts" in uncounted(mixtral)


@pytest.mark.engine
def test_the_embed_bench_times_the_same_texts_everywhere(tmp_path):
    """With the model's default prompt, a text near the limit went past it in ours only: ours refused it (an
    error row, thrown away) and was credited with it all the same ('3.57x'). A text past the limit with the
    prompt is now no one's, and every engine embeds the rest with the prompt."""
    from batchjob.bench.tasks import run_task_bench
    from batchjob.engine import Engine
    from tests.task_models import MAX_LEN, make_embedder

    folder = make_embedder(
        tmp_path / "emb", "bert", "mean", prompts={"query": "query: " * 6}, default_prompt_name="query"
    )
    engine = Engine.from_pretrained(str(folder), task="embed", dtype="float32")
    alone = lambda text: len(engine.tokenizer(text).input_ids)  # noqa: E731 - without the prompt
    near = next("x" * k for k in range(1, 4 * MAX_LEN) if alone("x" * k) == MAX_LEN)  # fits alone only
    words = ["one short text", near, "another short one"]
    assert len(engine.tokenize(near)) > MAX_LEN
    results = run_task_bench("embed", engine, words, [2], 2, progress=lambda _: None)
    assert {r.texts for r in results} == {2}
    assert results[0].tokens == len(engine.tokenize(words[0])) + len(engine.tokenize(words[2]))
