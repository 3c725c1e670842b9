"""A layer's per-row work on the CPU kernel library (engine/cpu/rows.py): the RMS norm equals transformers'
LlamaRMSNorm to the bit, the KV writes equal torch's ``index_copy_``, and an engine with both gives the
tokens and log-probabilities it gives without them."""

from __future__ import annotations

import platform

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from batchjob import Engine, SamplingParams
from batchjob.engine.attention.base import AttentionBackend
from batchjob.engine.cpu import kernel, rows

needs_kernel = pytest.mark.skipif(kernel.load() is None, reason="the CPU kernel library could not be built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@needs_kernel
def test_the_width_of_torchs_sums_is_found_on_x86():
    """Where torch's CPU kernels are x86 vector code the norm's kernel mirrors their sums; a None here would
    quietly leave every norm to torch."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"widths measured on x86 only, this is {platform.machine()}")
    assert rows.torch_lanes() in (8, 16)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 12, 64, 100, 576, 896, 1536, 4100])
def test_rms_norm_is_llamas_to_the_bit(dtype, width):
    """Widths below one vector, with a tail, and past the first levels of torch's cascade of sums; rows
    of very different scales; a strided input (a head's slice of a joint q/k/v product)."""
    torch.manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(1, 37, width) * torch.logspace(-3, 3, 37).view(1, 37, 1)).to(dtype)
    with torch.no_grad():
        assert torch.equal(_bits(rows.rms_norm(x, norm.weight, norm.variance_epsilon)), _bits(norm(x)))
        wide = torch.randn(1, 5, 3 * width).to(dtype)[..., width : 2 * width]
        assert torch.equal(_bits(rows.rms_norm(wide, norm.weight, 1e-6)), _bits(norm(wide)))


@needs_kernel
def test_norms_of_the_llama_layout_are_fused_and_others_kept(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "llama": LlamaRMSNorm(64),
            "qwen2": Qwen2RMSNorm(64),  # a copy of Llama's code: the same bytecode
            "gemma": GemmaRMSNorm(64),  # 1 + weight: another layout
            "float32_in_bf16": LlamaRMSNorm(64),  # a norm kept in float32 in a bf16 model
        }
    )
    for name, norm in model.items():
        torch.nn.init.normal_(norm.weight)
        if name != "float32_in_bf16":
            norm.to(torch.bfloat16)
    wide = LlamaRMSNorm(rows.SPLIT_ROW).to(torch.bfloat16)  # a row torch may sum on several threads
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert rows.fuse_norms(wide) == 0 and "forward" not in vars(wide)
        strided = LlamaRMSNorm(64)
        strided.weight = torch.nn.Parameter(torch.ones(128)[::2], requires_grad=False)
        assert rows.fuse_norms(strided) == 0  # the kernel reads the weight as one run of values
        want = {name: norm(x) for name, norm in model.items()}
        monkeypatch.setenv(rows.DISABLE_ENV, "0")
        assert rows.fuse_norms(model) == 0
        monkeypatch.delenv(rows.DISABLE_ENV)
        assert rows.fuse_norms(model) == 3
        assert rows.fuse_norms(model) == 0  # fused once; a forward set on the instance is left alone
        assert "forward" not in vars(model["gemma"])
        for name, norm in model.items():
            got = norm(x)
            assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kv_writes_equal_torchs_index_copy(dtype):
    torch.manual_seed(1)
    blocks, block_size, kv_heads, dim, tokens = 6, 4, 3, 16, 9
    # transformers hands the keys over as [1, KVH, T, D] views of a [1, T, KVH, D] tensor
    key = torch.randn(1, tokens, kv_heads, dim).to(dtype).transpose(1, 2)
    value = torch.randn(1, kv_heads, tokens, dim).to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, dim).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    AttentionBackend.write_kv(None, key, value, slots, *want)
    rows.write_kv(key, value, slots, *caches)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def _same_with_and_without_row_kernels(model_dir, monkeypatch, dtype, norm_class) -> None:
    prompts = [[5 + i, 17, 3 * i + 2, 40, 9] * (1 + i % 3) for i in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(rows.DISABLE_ENV, flag)
        engine = Engine.from_pretrained(model_dir, device="cpu", dtype=dtype, num_speculative_tokens=0)
        fused = [m for m in engine.model.modules() if "forward" in vars(m) and isinstance(m, norm_class)]
        assert bool(fused) == (flag == "1")
        outs = engine.generate(prompts, params)
        runs[flag] = [(o.token_ids, o.logprobs) for o in outs]
    assert runs["1"] == runs["0"]


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_the_same_tokens_and_logprobs_with_the_row_kernels(tiny_model_dir, monkeypatch, dtype):
    """The norms and the KV writes on the kernels, against torch's ops (BATCHJOB_CPU_ROWS=0): the same bits,
    so the same greedy tokens and log-probabilities, prompt chunks and decode steps alike."""
    _same_with_and_without_row_kernels(tiny_model_dir, monkeypatch, dtype, LlamaRMSNorm)


@needs_kernel
@pytest.mark.engine  # builds a Qwen3 model: seconds, not the unit tier's inner loop
def test_qwen3_head_norms_on_the_joint_q_k_v_columns_give_the_same_bits(tmp_path, monkeypatch):
    """Qwen3 norms each head's query and key (16 wide here) on its columns of the joint q/k/v product: a
    strided input, one row a head."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from tests.tiny_models import make_family_model

    make_family_model(tmp_path, "qwen3")
    _same_with_and_without_row_kernels(tmp_path, monkeypatch, "float32", Qwen3RMSNorm)
