"""Tensor parallelism on CPU with gloo: 2 ranks (the engine starts rank 1 itself) against the single-process
engine and HF ``generate``, token for token in float64; the tasks' hidden-states path; a rank killed or
hung; families refused by name."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from batchjob.engine import Engine
from batchjob.engine.parallel import check_shardable
from batchjob.errors import ConfigError, RankError
from batchjob.sampling import SamplingParams
from tests.tiny_models import hf_greedy, make_model

pytestmark = pytest.mark.timeout(600)

# Small pool and budget: prompts are prefilled in chunks of 8 tokens, 14 blocks of 4 tokens force
# preemptions, and the first two prompts share three full blocks (prefix caching).
OPTIONS = dict(device="cpu", dtype="float64", max_num_batched_tokens=8, block_size=4, num_blocks=14)
SHARED = list(range(20, 32))
PROMPTS = [
    SHARED + [5, 6, 7],
    SHARED + [9, 10],
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [40, 41, 42, 40, 41, 42, 40],  # repeats: prompt-lookup drafts get verified
]
NEW = 10
FAMILIES = {"llama": {}, "qwen2": {"num_key_value_heads": 2}, "mixtral": {}, "qwen2_moe": {}}


@pytest.fixture(scope="module")
def tp_dirs(tiny_model_dirs, tmp_path_factory):
    """Tiny models of the families under test (qwen2 with 2 KV heads: the session's has 1)."""
    root = tmp_path_factory.mktemp("tp_models")
    dirs = {"llama": tiny_model_dirs["llama"]}
    for family, overrides in FAMILIES.items():
        if family not in dirs:
            dirs[family] = make_model(root / family, family, **overrides)
    return dirs


def _greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


CHOICES = SamplingParams(choices=["good", "bad", "neutral"], temperature=0)
TEXTS = ["Review: it was great\nSentiment:", "Review: broke after a day\nSentiment:"]


def _same_choices(got, want) -> None:
    assert [o.text for o in got] == [o.text for o in want]
    for g, w in zip(got, want, strict=True):
        assert g.choice_logprobs.keys() == w.choice_logprobs.keys()
        np.testing.assert_allclose(
            list(g.choice_logprobs.values()), list(w.choice_logprobs.values()), rtol=1e-9
        )


@pytest.mark.process  # starts its rank processes
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_equal_one_process_and_hf_generate(tp_dirs, family, drafts_pay):
    """Greedy generation under TP 2; on llama, choice scoring requests too (the same ranks: one start)."""
    from transformers import AutoModelForCausalLM

    tp = Engine.from_pretrained(str(tp_dirs[family]), tensor_parallel_size=2, **OPTIONS)
    try:
        group = tp.runner.tensor_parallel
        attn = tp.model.model.layers[0].self_attn
        assert attn.q_proj.out_features == tp.model.config.num_attention_heads * attn.head_dim // 2
        assert tp.runner.kv_caches[0][0].shape[2] == tp.model.config.num_key_value_heads // 2
        got = _greedy(tp)
        assert group.reduce_calls > 0 and group.broadcast_bytes > 0
        assert tp.stats.preemptions > 0, "the pool was meant to force preemptions"
        assert tp.stats.cached_prompt_tokens > 0, "the shared prefix was meant to come from the cache"
        if family == "llama":  # (whether a model's answers repeat their context depends on its weights)
            assert tp.stats.draft_tokens > 0, "the repeating prompt was meant to draft"
            choices = tp.generate(TEXTS, CHOICES)
    finally:
        tp.close()
    assert not dist.is_initialized()
    one = Engine.from_pretrained(str(tp_dirs[family]), **OPTIONS)
    single = _greedy(one)
    if family == "llama":
        _same_choices(choices, one.generate(TEXTS, CHOICES))
    hf = AutoModelForCausalLM.from_pretrained(str(tp_dirs[family]), dtype=torch.float64)
    if getattr(hf.config, "_experts_implementation", None) == "grouped_mm":  # no float64 kernel
        hf.set_experts_implementation("eager")
    assert got == single
    assert got == [hf_greedy(hf, p, NEW) for p in PROMPTS]


@pytest.mark.process  # starts its rank processes
def test_embed_goes_through_every_rank(tp_dirs):
    """A prefill-only task (hidden states, not logits) under TP 2 (choice scoring: the llama case above)."""
    d = str(tp_dirs["llama"])
    texts = TEXTS
    tp = Engine.from_pretrained(d, tensor_parallel_size=2, task="embed", **OPTIONS)
    try:
        got = tp.embed(texts)
    finally:
        tp.close()
    want = Engine.from_pretrained(d, task="embed", **OPTIONS).embed(texts)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.embedding, w.embedding, rtol=1e-9, atol=1e-12)


@pytest.mark.process  # starts its rank processes
def test_a_killed_rank_stops_the_step_with_its_name(tp_dirs):
    tp = Engine.from_pretrained(str(tp_dirs["llama"]), tensor_parallel_size=2, **OPTIONS)
    follower = tp.runner.tensor_parallel.procs[0]
    os.kill(follower.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) died \(killed by signal 9\)"):
        _greedy(tp)
    assert time.monotonic() - t0 < 15
    assert not dist.is_initialized()  # a new engine can start in this process
    with pytest.raises(ConfigError, match="one rank's shard of a tensor-parallel engine"):
        Engine(tp.model, tp.tokenizer, tp.config)  # (as --estimate's calibration would)


@pytest.mark.process  # starts its rank processes
def test_a_hung_rank_is_caught_by_the_timeout(tp_dirs, monkeypatch):
    monkeypatch.setenv("BATCHJOB_TP_TIMEOUT", "3")
    tp = Engine.from_pretrained(str(tp_dirs["llama"]), tensor_parallel_size=2, **OPTIONS)
    follower = tp.runner.tensor_parallel.procs[0]
    os.kill(follower.pid, signal.SIGSTOP)  # alive, never answering
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"did not finish within 3 s"):
        _greedy(tp)
    assert time.monotonic() - t0 < 30
    assert follower.poll() is not None  # stopped by rank 0, not left behind
    assert not dist.is_initialized()


def test_families_without_a_plan_or_divisible_heads_are_refused_by_name(tiny_model_dirs):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    with pytest.raises(ConfigError, match=r"'gpt2' has no tensor-parallel plan"):
        check_shardable(GPT2Config(), 2)
    with pytest.raises(ConfigError, match=r"'qwen2' has 1 KV heads, not divisible by tensor_parallel_size 2"):
        check_shardable(Qwen2Config(num_attention_heads=4, num_key_value_heads=1), 2)
    with pytest.raises(ConfigError, match=r"6 attention heads, not divisible by tensor_parallel_size 4"):
        check_shardable(LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=6), 4)
    check_shardable(GPT2Config(), 1)
    check_shardable(LlamaConfig(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64), 4)
    # Cohere's q/k norms hold a weight a head, left whole by its plan (a rank with half the heads crashed)
    from transformers import CohereConfig

    with pytest.raises(ConfigError, match=r"'cohere' with use_qk_norm: its per-head norm weights"):
        check_shardable(CohereConfig(num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True), 2)
    check_shardable(CohereConfig(num_attention_heads=4, num_key_value_heads=2), 2)
    # From the engine: refused from the config, before a rank is started or a weight read.
    with pytest.raises(ConfigError, match=r"'gpt2' has no tensor-parallel plan"):
        Engine.from_pretrained(str(tiny_model_dirs["gpt2"]), tensor_parallel_size=2, device="cpu")
    assert not dist.is_initialized()


def test_the_command_line_refuses_before_work(tiny_model_dirs, tmp_path):
    """``validate`` and ``run`` with a family that has no plan: exit 2, the family named, no traceback."""
    from click.testing import CliRunner

    from batchjob.cli import main

    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["--input", str(data), "--output", str(tmp_path / "out"), "--model", str(tiny_model_dirs["gpt2"])]
    args += ["--tensor-parallel-size", "2", "--device", "cpu"]
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, *args])
        assert result.exit_code == 2, result.output
        assert "'gpt2' has no tensor-parallel plan" in result.output
        assert "Traceback" not in result.output
    assert not list((tmp_path / "out").glob("*.parquet"))
    assert not dist.is_initialized()
