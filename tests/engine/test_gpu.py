"""GPU checks: skipped without CUDA (see conftest). Run them where a GPU exists: pytest -m gpu."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.attention import flex_kernel as flex
from batchjob.engine.attention.flash import installed as flash_attn_available
from batchjob.engine.attention.varlen import Varlen
from tests.engine.test_flex import MIXED, _alibi_slopes, _flex_meta, _hf_greedy, _reference, _step
from tests.tiny_models import random_prompts as _prompts

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
DEVICE = "cuda"


def _hf_greedy_cuda(folder, prompts, max_new_tokens):
    return _hf_greedy(folder, prompts, max_new_tokens, device="cuda")


@pytest.mark.parametrize("backend", ["flex", "torch"])
def test_cuda_attention_equals_hf_generate(tiny_model_dir, backend):
    """float64: flex runs its dense path (the metadata and mask code of the kernel), torch the reference."""
    engine = Engine.from_pretrained(
        str(tiny_model_dir),
        dtype="float64",
        device="cuda",
        block_size=16,
        max_num_batched_tokens=64,
        attention_backend=backend,
    )
    assert engine.runner.attention.name == backend
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
    assert flash.runner.attention.name == "flash_attn"
    ref = Engine.from_pretrained(str(tiny_model_dir), **kwargs)
    ref.runner.attention = ref.runner.new_backend("torch")  # the reference, in its graphs too
    prompts = _prompts([3, 50, 300], flash.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    a = [o.token_ids for o in flash.generate(prompts, params)]
    b = [o.token_ids for o in ref.generate(prompts, params)]
    agree = sum(x == y for x, y in zip(a, b, strict=True))
    assert agree >= 2, (a, b)  # bf16 rounding may flip a token of a random model, not most of them


def test_cuda_graphs_replay_decode_steps_exactly(tiny_model_dir, drafts_pay):
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


# -- FlexAttention compiled by Triton (the default CUDA path without flash-attn) ---------------------------------


def test_default_cuda_backend_is_flex_at_16_token_blocks(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cuda", max_num_batched_tokens=64)
    expected = ("flash_attn", 256) if flash_attn_available() else ("flex", 16)
    assert (engine.runner.attention.name, engine.config.block_size) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("softcap", "alibi", "sinks", "window"), [(None, False, False, None), (2.0, True, True, 6)]
)
def test_compiled_flex_kernel_on_cuda(dtype, softcap, alibi, sinks, window):
    """The Triton kernel against the float64 reference: it must compile (no fall-back to the dense path)."""
    heads, kv_heads, bs = 8, 2, 16
    q, k_cache, v_cache, tables = _step(
        4, MIXED, heads=heads, kv_heads=kv_heads, dim=64, block_size=bs, dtype=dtype, num_blocks=64
    )
    q, k_cache, v_cache = q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE)
    state = flex.FlexState(k_cache.shape[0], bs, dtype, torch.device(DEVICE), 64)
    meta = _flex_meta(state, MIXED, tables, heads // kv_heads, torch.device(DEVICE))
    slopes = _alibi_slopes(heads).float().to(DEVICE) if alibi else None
    sink = torch.linspace(-2.0, 3.0, heads, device=DEVICE) if sinks else None
    out = flex.paged_flex_attention(q, k_cache, v_cache, meta, 0.125, window, softcap, slopes, sink)
    assert state.compiled, "Triton did not compile the paged FlexAttention kernel"
    ref = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), MIXED, tables, 0.125, window, softcap,
                     None if slopes is None else slopes.cpu(), None if sink is None else sink.cpu())  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)


def test_compiled_flex_engine_on_cuda_equals_hf_generate(tiny_model_dir):
    """float32 through Triton, with chunked prefill and graph-captured decode steps: HF generate's tokens."""
    engine = Engine.from_pretrained(
        str(tiny_model_dir),
        dtype="float32",
        device="cuda",
        block_size=16,
        max_num_batched_tokens=64,
        attention_backend="flex",
    )
    prompts = _prompts([1, 9, 40, 130, 5], engine.vocab_size, seed=6) + [[7, 8, 9, 10] * 10]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert engine.runner.attention.state.compiled
    assert engine.runner.graphs.replays > 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
        assert o.token_ids == ref[0, len(p) :].tolist()


@pytest.mark.skipif(
    torch.cuda.is_available() and Varlen.missing(torch.device("cuda"), torch.bfloat16) is not None,
    reason="this torch's varlen_attn has no paged cache (block_table): batchjob refuses it",
)
def test_varlen_agrees_with_flex_in_bf16(tiny_model_dir):
    """torch's built-in FlashAttention-2 (varlen_attn, 256-token pages) against flex (16-token pages)."""
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = _prompts([3, 50, 300], 400, seed=2)
    outs = {}
    for backend in ("varlen", "flex"):
        engine = Engine.from_pretrained(
            str(tiny_model_dir),
            dtype="bfloat16",
            device="cuda",
            max_num_batched_tokens=128,
            attention_backend=backend,
        )
        assert engine.runner.attention.name == backend
        assert engine.config.block_size == (256 if backend == "varlen" else 16)
        outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    agree = sum(a == b for a, b in zip(outs["varlen"], outs["flex"], strict=True))
    assert agree >= 2, outs  # bf16 rounding may flip a token of a random model, not most of them


def family_agreement(folder, device: str, dtype: torch.dtype, new_tokens: int = 8) -> tuple[int, int]:
    """(tokens equal to HF ``generate`` up to each sequence's first difference, tokens in all) for one family
    of the matrix, our engine and HF on the same device and dtype, under the matrix's pressure (chunked
    prompts longer than the windows, prefix caching)."""
    from tests.engine.test_families import _engine_options, _prompts, _reference
    from tests.tiny_models import hf_greedy

    options = _engine_options() | {"device": device, "num_blocks": 64}
    engine = Engine.from_pretrained(str(folder), dtype=str(dtype).removeprefix("torch."), **options)
    hf = _reference(folder, dtype).to(device)
    same = total = 0
    prompts = _prompts(engine.vocab_size) + _prompts(engine.vocab_size, seed=1)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        ref = hf_greedy(hf, prompt, new_tokens)
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=True)) if a != b), len(ref))
        same, total = same + first, total + len(ref)
    return same, total


def test_family_matrix_in_bf16_agreement_rate(tmp_path, capsys):
    """The family matrix in bf16 on the GPU against HF ``generate`` in bf16 there: ties flip in bf16, so the
    agreement rate (tokens equal before a sequence's first difference) is measured and printed per family.
    A broken attention path agrees on a token or two at most; each family must agree on most."""
    from tests.engine.test_families import REFUSED
    from tests.tiny_models import FAMILIES, make_family_model

    rates = {}
    with capsys.disabled():  # printed as it goes: a run cut short by a time limit keeps what it measured
        print("\nbf16 family matrix on", torch.cuda.get_device_name(), "(engine vs HF generate, both bf16):")
        for family in FAMILIES:
            if family in REFUSED:
                continue
            folder = make_family_model(tmp_path / family, family)
            same, total = family_agreement(folder, DEVICE, torch.bfloat16)
            rates[family] = same / total
            print(f"  {family:12s} {same}/{total} tokens agree ({same / total:.0%})", flush=True)
        print(f"  all          {sum(rates.values()) / len(rates):.0%} (mean of families)")
    assert min(rates.values()) >= 0.5, rates


def test_roofline_weight_sweep_replays_from_a_cuda_graph(tiny_model_dir):
    """Eager, a decode-shaped sweep of every linear times kernel launches (the first H200 run's 260 GB/s)."""
    from batchjob.bench import roofline

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    limits = roofline.measure_limits(model, torch.device(DEVICE), torch.bfloat16, gemm_tokens=256)
    assert "weight sweep from a CUDA graph" in limits.features, limits.features
    assert limits.bandwidth > 0 and limits.peak_flops > 0
