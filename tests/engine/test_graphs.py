"""Decode steps through padded graph buckets (CUDA graphs on a GPU; here the same buffers run eagerly) and the
model under torch.compile: both must give Hugging Face generate's tokens."""

from __future__ import annotations

import random
import sys
import types

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.graphs import ROW_BUCKETS, DecodeGraphs
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.timeout(600)


def _hf_greedy(folder, prompts, max_new_tokens):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return [hf_greedy(hf, p, max_new_tokens) for p in prompts]


def _prompts(seed, lengths, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _runner(kv_caches, block_size):
    """What DecodeGraphs reads of its ModelRunner, for tests that never run the model."""
    return types.SimpleNamespace(
        kv_caches=kv_caches,
        block_size=block_size,
        device=torch.device("cpu"),
    )


def test_buckets_round_rows_and_blocks_up():
    g = DecodeGraphs(_runner([], 16), 0, 100, 40)
    assert g.max_rows == 96  # the largest bucket within the limit
    assert g.bucket(1, 1) == (1, 1)
    assert g.bucket(3, 3) == (4, 4)
    assert g.bucket(17, 33) == (24, 40)  # blocks: a power of two, capped at the model's longest context
    assert g.bucket(96, 40) == (96, 40)
    assert g.bucket(97, 1) is None and g.bucket(1, 41) is None
    assert list(ROW_BUCKETS) == sorted(set(ROW_BUCKETS))


def test_padding_rows_write_only_the_scratch_block():
    """A step of 3 rows in a bucket of 4: the padding row's key lands in the scratch block, nowhere else."""
    kv = [(torch.zeros(5, 4, 1, 8, dtype=torch.float64), torch.zeros(5, 4, 1, 8, dtype=torch.float64))]
    g = DecodeGraphs(_runner(kv, 4), 4, 8, 4)
    graph = g._build(4, 2)
    tables = np.array([[0, 1], [2, 0], [3, 0]])
    g._fill(graph, np.array([5, 6, 7]), np.array([5, 0, 2]), np.array([5, 8, 14]), tables)
    graph.device_buf.copy_(graph.host)
    ids, positions, slots, lens, table = (t.tolist() for t in g._views(graph))
    assert ids == [5, 6, 7, 0] and positions == [5, 0, 2, 0]
    assert slots == [5, 8, 14, 16]  # the padding row writes slot 0 of block 4, the scratch block
    assert lens == [6, 1, 3, 1]
    assert table == [[0, 1], [2, 0], [3, 0], [4, 4]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_graph_buckets_equal_hf_generate(tiny_model_dirs, family, decode_path, drafts_pay):
    folder = tiny_model_dirs[family]
    engine = Engine.from_pretrained(
        str(folder), dtype="float64", device="cpu", block_size=4, cuda_graphs=True
    )
    graphs = engine.runner.graphs
    assert graphs is not None and (engine.runner.attention.name == "cpu_kernel") == (decode_path == "kernel")
    # The scratch block is the pool's last, outside what the block manager hands out.
    assert engine.runner.kv_caches[0][0].shape[0] == engine.block_manager.num_blocks + 1
    assert graphs.scratch_block == engine.block_manager.num_blocks
    prompts = _prompts(1, [1, 6, 19, 44, 3, 90, 7], engine.vocab_size)
    # Repeating prompts give drafts, so verification rows go through the buckets too.
    prompts.append([11, 12, 13, 14] * 8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(folder, prompts, 24)
    assert graphs.replays > 0
    assert engine.stats.accepted_draft_tokens > 0
    assert len({rows for rows, _ in graphs._graphs}) > 1  # requests finishing moved steps between buckets


def test_graph_buckets_keep_seeded_sampling(tiny_model_dir):
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    prompts = _prompts(2, [4, 30, 12], 400)
    eager = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu")
    graphs = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu", cuda_graphs=True)
    assert eager.runner.graphs is None
    a = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphs.generate(prompts, params)] == a
    assert graphs.runner.graphs.replays > 0


def test_compiled_model_equals_hf_generate(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu", compile=True)
    prompts = _prompts(3, [2, 15, 33], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(tiny_model_dir, prompts, 10)
    assert engine.runner.forward is not engine.model  # still the compiled wrapper: no fallback to eager


def test_a_failing_compile_falls_back_to_eager(tiny_model_dir, caplog):
    engine = Engine.from_pretrained(str(tiny_model_dir), dtype="float64", device="cpu", compile=True)

    def broken(**kwargs):
        raise RuntimeError("no C++ compiler")  # what inductor raises where it cannot build

    engine.runner.forward = broken
    prompts = _prompts(4, [3, 12], engine.vocab_size)
    with caplog.at_level("WARNING"):
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(tiny_model_dir, prompts, 6)
    assert engine.runner.forward is engine.model
    assert sum("torch.compile failed" in r.message for r in caplog.records) == 1


def _flash_varlen_in_torch(
    q,
    k_cache,
    v_cache,
    cu_q,
    cu_k,
    max_q,
    max_k,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    block_table=None,
):
    """flash-attn's paged varlen call written out in torch (bottom-right causal): what our metadata asks."""
    assert causal and block_table is not None
    out = torch.empty_like(q)  # [T, H, D]
    bs, kv_heads, dim = k_cache.shape[1:]
    for i in range(len(cu_q) - 1):
        qs, qe, klen = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i + 1] - cu_k[i])
        assert qe - qs <= max_q and klen <= max_k
        blocks = block_table[i, : -(-klen // bs)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:klen].transpose(0, 1)[None]
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:klen].transpose(0, 1)[None]
        qpos = torch.arange(klen - (qe - qs), klen)[:, None]
        kpos = torch.arange(klen)[None, :]
        mask = kpos <= qpos
        if window_size[0] >= 0:
            mask &= kpos >= qpos - window_size[0]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1)[None], k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=True
        )
        out[qs:qe] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_flash_metadata_equals_hf_generate(tiny_model_dir, monkeypatch, cuda_graphs):
    """The flash-attn path's metadata (cu_seqlens, block tables; eager and in graph buckets), checked on the
    CPU through a torch rendering of flash-attn's paged varlen call."""
    calls = []

    def flash(*args, **kwargs):
        calls.append(args[0].shape[0])
        return _flash_varlen_in_torch(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash))
    engine = Engine.from_pretrained(
        str(tiny_model_dir),
        dtype="float64",
        device="cpu",
        block_size=8,
        max_num_batched_tokens=48,
        cuda_graphs=cuda_graphs,
    )
    engine.runner.attention = engine.runner.new_backend("flash_attn")  # CUDA only: forced, with the graphs
    prompts = _prompts(6, [1, 9, 70, 30], engine.vocab_size) + [[21, 22, 23, 24] * 6]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(tiny_model_dir, prompts, 16)
    assert calls  # attention went through the flash call
    if cuda_graphs:
        assert engine.runner.graphs.replays > 0
