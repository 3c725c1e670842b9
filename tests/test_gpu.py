"""GPU checks: skipped without CUDA (see conftest). Run them where a GPU exists: pytest -m gpu."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.attention import flash_attn_available

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _prompts(n_tokens, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in n_tokens]


def _hf_greedy_cuda(folder, prompts, max_new_tokens):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


def test_cuda_reference_attention_equals_hf_generate(tiny_model_dir):
    engine = Engine.from_pretrained(
        str(tiny_model_dir), dtype="float64", device="cuda", block_size=16, max_num_batched_tokens=64
    )
    assert not engine.runner.use_flash  # float64 and 16-token blocks take the reference path
    prompts = _prompts([1, 9, 40, 130], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy_cuda(tiny_model_dir, prompts, 12)


def test_seeded_sampling_is_the_same_on_cpu_and_cuda(tiny_model_dir):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    prompts = _prompts([7, 20], 400, seed=1)
    cpu = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu").generate(prompts, params)
    gpu = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cuda").generate(
        prompts, params
    )
    assert [o.token_ids for o in cpu] == [o.token_ids for o in gpu]


@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn is not installed")
def test_flash_attention_matches_the_reference(tiny_model_dir):
    kwargs = dict(dtype="bfloat16", device="cuda", block_size=256, max_num_batched_tokens=128)
    flash = Engine.from_pretrained(str(tiny_model_dir), **kwargs)
    assert flash.runner.use_flash
    ref = Engine.from_pretrained(str(tiny_model_dir), **kwargs)
    ref.runner.use_flash = False  # the reference path, in its graphs too (they read the runner's flag)
    prompts = _prompts([3, 50, 300], flash.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    a = [o.token_ids for o in flash.generate(prompts, params)]
    b = [o.token_ids for o in ref.generate(prompts, params)]
    agree = sum(x == y for x, y in zip(a, b, strict=True))
    assert agree >= 2, (a, b)  # bf16 rounding may flip a token of a random model, not most of them


def test_cuda_graphs_replay_decode_steps_exactly(tiny_model_dir):
    """Decode steps replayed from captured graphs (drafting rows included) give HF generate's tokens."""
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cuda", block_size=16)
    graphs = engine.runner.graphs
    assert graphs is not None  # on by default on CUDA
    prompts = _prompts([1, 9, 40, 130, 5], engine.vocab_size, seed=4) + [[7, 8, 9, 10] * 10]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    assert graphs.enabled and graphs.replays > 0
    assert all(g.graph is not None for g in graphs._graphs.values())
    assert engine.stats.accepted_draft_tokens > 0
    assert [o.token_ids for o in outs] == _hf_greedy_cuda(tiny_model_dir, prompts, 20)


def test_cuda_graphs_and_compile_keep_seeded_sampling(tiny_model_dir):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    prompts = _prompts([7, 20, 64], 400, seed=5)
    kw = dict(dtype="float64", device="cuda")
    eager = Engine.from_pretrained(str(tiny_model_dir), cuda_graphs=False, **kw).generate(prompts, params)
    graphs = Engine.from_pretrained(str(tiny_model_dir), compile=True, **kw).generate(prompts, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
