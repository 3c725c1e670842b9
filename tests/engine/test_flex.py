"""The FlexAttention backend: packed paged attention against per-request references, the score mods
(soft-capping, ALiBi, sinks), the engine against Hugging Face generate with flex forced (and on Gemma-2 and
gpt-oss, which need it), compile behaviour, and the one backend choice shared by the engine and the job."""

from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, BloomConfig, Gemma2Config, GptOssConfig

from batchjob import Engine, SamplingParams
from batchjob.engine.attention import flash as flash_backend
from batchjob.engine.attention import flex_kernel as flex
from batchjob.engine.attention import varlen as varlen_backend
from batchjob.engine.attention.registry import AttentionChoice, choose_attention, supported_features
from batchjob.engine.config import EngineConfig, resolve_dtype
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.support import attention_features
from batchjob.errors import ConfigError
from batchjob.job import runner as job_runner
from batchjob.job.spec import make_spec
from tests.engine.test_graphs import _flash_varlen_in_torch
from tests.tiers import engine_fixture
from tests.tiny_models import hf_greedy, make_model, make_tokenizer

pytestmark = pytest.mark.timeout(600)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


# -- the kernel against per-request references -------------------------------------------------------------


def _alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)


def _step(seed, requests, *, heads, kv_heads, dim, block_size, dtype, num_blocks=96):
    """A random paged cache and one packed step: requests (context length, new tokens), pages scattered over
    the pool, request 1 holding request 0's first full pages (a shared prefix)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for i, (ctx, n) in enumerate(requests):
        shared = []
        if i == 1:
            shared = tables[0][: min(requests[0][0], ctx - n) // block_size]
        tables.append(shared + [free.pop() for _ in range(-(-ctx // block_size) - len(shared))])
    total = sum(n for _, n in requests)
    q = torch.randn(heads, total, dim, generator=gen, dtype=dtype)
    return q, k_cache, v_cache, tables


def _flex_meta(state, requests, tables, group, device=CPU):
    n = np.array([r[1] for r in requests], dtype=np.int64)
    starts = np.array([r[0] - r[1] for r in requests], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(n)])
    table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    calls = flex.plan_calls(n, starts, offsets, table, state.block_size, state.q_block // group + 1)
    sets = [
        flex.FlexSeqs(*(torch.from_numpy(a).to(device) for a in (r.reshape(-1), t, s, q)), length, kind)
        for r, t, s, q, length, kind in calls
    ]
    return state.begin(sets)


def _reference(q, k_cache, v_cache, requests, tables, scale, window, softcap=None, slopes=None, sinks=None):
    """Each request alone, written out in float64: scores of its gathered keys, soft-cap, ALiBi, the mask,
    a softmax with a sink column, the weighted values. Returns [T, H, D]."""
    heads, _, dim = q.shape
    kv_heads = k_cache.shape[2]
    out, row = [], 0
    for (ctx, n), pages in zip(requests, tables, strict=True):
        k = k_cache[pages].reshape(-1, kv_heads, dim)[:ctx].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[pages].reshape(-1, kv_heads, dim)[:ctx].double().repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hnd,khd->hnk", q[:, row : row + n].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(ctx - n, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        if slopes is not None:
            s = s + slopes.double()[:, None, None] * (kpos - qpos)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        s = s.masked_fill(~mask, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(heads, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :ctx]
        out.append(torch.einsum("hnk,khd->nhd", p, v))
        row += n
    return torch.cat(out)


def _sdpa_reference(q, k_cache, v_cache, requests, tables, scale, window):
    """The same without score mods, by SDPA on each request's gathered keys."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    out, row = [], 0
    for (ctx, n), pages in zip(requests, tables, strict=True):
        k = k_cache[pages].reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1)[None]
        v = v_cache[pages].reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1)[None]
        qpos, kpos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = torch.nn.functional.scaled_dot_product_attention(
            q[None, :, row : row + n], k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(out)


# Decode rows (1 token) of short and long contexts, prompt chunks with and without cached keys, a chunk
# ending mid-page, one reaching past several windows, and request 1 sharing request 0's first pages.
MIXED = [(37, 1), (45, 12), (1, 1), (16, 16), (70, 1), (33, 9), (5, 5), (100, 31), (17, 1)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "window"),
    [(4, 2, 4, 5), (4, 4, 16, None), (6, 2, 16, 7), (4, 1, 4, None)],
)
def test_dense_equals_sdpa_per_request(heads, kv_heads, block_size, window):
    q, k_cache, v_cache, tables = _step(
        1, MIXED, heads=heads, kv_heads=kv_heads, dim=16, block_size=block_size, dtype=torch.float64
    )
    state = flex.FlexState(k_cache.shape[0], block_size, torch.float64, CPU, 64)
    assert not state.compiled  # float64 runs the dense path
    meta = _flex_meta(state, MIXED, tables, heads // kv_heads)
    assert [s.kind for s in meta.sets] == [flex.DECODE, flex.CHUNKS]
    out = flex.paged_flex_attention(q, k_cache, v_cache, meta, 0.25, window)
    ref = _sdpa_reference(q, k_cache, v_cache, MIXED, tables, 0.25, window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.engine  # the attention kernels over whole packed steps: seconds, not the unit tier's inner loop
@pytest.mark.parametrize(
    ("softcap", "alibi", "sinks", "window"),
    [(2.0, False, False, None), (None, True, False, 6), (None, False, True, 6), (1.5, True, True, None)],
)
def test_dense_score_mods_equal_the_written_out_reference(softcap, alibi, sinks, window):
    heads, kv_heads = 6, 2
    q, k_cache, v_cache, tables = _step(
        2, MIXED, heads=heads, kv_heads=kv_heads, dim=16, block_size=4, dtype=torch.float64
    )
    state = flex.FlexState(k_cache.shape[0], 4, torch.float64, CPU, 64)
    meta = _flex_meta(state, MIXED, tables, heads // kv_heads)
    slopes = _alibi_slopes(heads) if alibi else None
    sink = torch.linspace(-2.0, 3.0, heads, dtype=torch.float64) if sinks else None
    out = flex.paged_flex_attention(q, k_cache, v_cache, meta, 0.3, window, softcap, slopes, sink)
    ref = _reference(q, k_cache, v_cache, MIXED, tables, 0.3, window, softcap, slopes, sink)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    plain = _reference(q, k_cache, v_cache, MIXED, tables, 0.3, window)
    assert (out - plain).abs().max() > 1e-3  # the mods change the answer


@pytest.mark.engine  # the attention kernels over whole packed steps: seconds, not the unit tier's inner loop
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dense_path_is_flex_attentions_own_semantics():
    """The dense path against FlexAttention itself (its eager implementation) on gathered keys: the same
    mods through flex_attention's score_mod/mask_mod and its log-sum-exp give the same output."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    heads, kv_heads, bs, window, softcap = 4, 2, 4, 6, 2.0
    requests = [(23, 7), (9, 1)]
    q, k_cache, v_cache, tables = _step(
        3, requests, heads=heads, kv_heads=kv_heads, dim=16, block_size=bs, dtype=torch.float64
    )
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    state = flex.FlexState(k_cache.shape[0], bs, torch.float64, CPU, 8)
    ours = flex.paged_flex_attention(
        q, k_cache, v_cache, _flex_meta(state, requests, tables, 2), 0.25, window, softcap, None, sinks
    )
    row = 0
    for (ctx, n), pages in zip(requests, tables, strict=True):
        k = k_cache[pages].reshape(-1, kv_heads, 16)[:ctx].transpose(0, 1)[None]
        v = v_cache[pages].reshape(-1, kv_heads, 16)[:ctx].transpose(0, 1)[None]

        def mask_mod(b, h, qi, ki, ctx=ctx, n=n):
            return flex.visible(qi + ctx - n, ki, qi >= 0, window)

        def score_mod(score, b, h, qi, ki, ctx=ctx, n=n):
            return flex.modify_score(score, h, qi + ctx - n, ki, softcap, None)

        mask = create_block_mask(mask_mod, 1, 1, n, ctx, device="cpu")
        o, aux = flex_attention(
            q[None, :, row : row + n],
            k,
            v,
            score_mod,
            mask,
            scale=0.25,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )
        folded = o.view(1, kv_heads, 2, n, 16).permute(0, 1, 3, 2, 4).reshape(1, kv_heads, n * 2, 16)
        lse = aux.lse.view(1, kv_heads, 2, n).permute(0, 1, 3, 2).reshape(1, kv_heads, n * 2)
        theirs = (
            flex.apply_sinks(folded, lse, sinks)
            .view(kv_heads, n, 2, 16)
            .permute(1, 0, 2, 3)
            .reshape(n, heads, 16)
        )
        torch.testing.assert_close(ours[row : row + n], theirs, rtol=1e-10, atol=1e-10)
        row += n


@pytest.mark.engine  # torch.compile: inductor's compile workers
@pytest.mark.parametrize(("softcap", "alibi", "window"), [(None, False, None), (2.0, True, 5)])
def test_compiled_kernel_equals_reference(softcap, alibi, window):
    """The compiled kernel (inductor's CPU template; Triton on CUDA runs the same code): float32 against the
    float64 reference. It must stay compiled: eagerly, FlexAttention ignores the BlockMask's sparsity."""
    heads, kv_heads, bs = 4, 2, 4
    q, k_cache, v_cache, tables = _step(
        4, MIXED, heads=heads, kv_heads=kv_heads, dim=16, block_size=bs, dtype=torch.float32
    )
    state = flex.FlexState(k_cache.shape[0], bs, torch.float32, CPU, 64)
    assert state.compiled
    slopes = _alibi_slopes(heads).float() if alibi else None
    for seed in (4, 5):  # a second step of other shapes reuses the kernels
        if seed == 5:
            q, k_cache, v_cache, tables = _step(
                5,
                MIXED[::-1],
                heads=heads,
                kv_heads=kv_heads,
                dim=16,
                block_size=bs,
                dtype=torch.float32,
                num_blocks=140,
            )
            state = flex.FlexState(k_cache.shape[0], bs, torch.float32, CPU, 64)
        requests = MIXED if seed == 4 else MIXED[::-1]
        meta = _flex_meta(state, requests, tables, heads // kv_heads)
        out = flex.paged_flex_attention(q, k_cache, v_cache, meta, 0.25, window, softcap, slopes)
        assert state.compiled, "the kernel fell back to the dense path"
        ref = _reference(q, k_cache, v_cache, requests, tables, 0.25, window, softcap, slopes)
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_block_mask_lists_only_the_requests_own_pages():
    """The sparsity the compiled kernel relies on: each query block lists only its request's pages, up to its
    last query's page and (window) from its first query's reach; full pages are seen whole by every query."""
    bs, window = 4, 6
    requests = [(30, 1), (45, 12), (9, 9)]
    _, k_cache, _, tables = _step(
        6, requests, heads=2, kv_heads=1, dim=16, block_size=bs, dtype=torch.float32
    )
    state = flex.FlexState(k_cache.shape[0], bs, torch.float64, CPU, 8)
    meta = _flex_meta(state, requests, tables, 2)
    group, q_block = 2, state.q_block
    by_kind = {s.kind: s for s in meta.sets}
    members = {flex.DECODE: [0], flex.CHUNKS: [1, 2]}
    for kind, seqs in by_kind.items():
        for w in (None, window):
            kv_num, kv_idx, full_num, full_idx = flex.block_tensors(
                seqs, group, q_block, bs, w, seqs.table.shape[1]
            )
            for b, req in enumerate(members[kind]):
                ctx, n = requests[req]
                own = tables[req]
                for j in range(kv_num.shape[2]):
                    rows = range(j * q_block, min((j + 1) * q_block, n * group))
                    listed = (
                        kv_idx[b, 0, j, : kv_num[b, 0, j]].tolist()
                        + full_idx[b, 0, j, : full_num[b, 0, j]].tolist()
                    )
                    if not rows:
                        assert not listed
                        continue
                    qpos = [ctx - n + r // group for r in rows]
                    seen = {
                        own[k // bs] for p in qpos for k in range(ctx) if k <= p and (w is None or k > p - w)
                    }
                    assert set(listed) == seen and len(listed) == len(seen)
                    for page in full_idx[b, 0, j, : full_num[b, 0, j]].tolist():
                        keys = [own.index(page) * bs + i for i in range(bs)]
                        assert all(k <= p and (w is None or k > p - w) for p in qpos for k in keys)
        assert all(b >= 2 for b in seqs.table.shape)  # padded: no dynamic dimension of size 1


# -- the engine with flex forced, against Hugging Face ------------------------------------------------------


def _hf_greedy(folder, prompts, max_new_tokens, dtype=torch.float64, device="cpu", **load):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **load).to(device).eval()
    return [hf_greedy(hf, p, max_new_tokens) for p in prompts]


def _prompts(seed, lengths, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture
def force_flex():
    """The engine option that forces the flex backend."""
    return {"attention_backend": "flex"}


@engine_fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("mistral") / "m", "mistral")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_flex_engine_equals_hf_generate(
    tiny_model_dirs, mistral_dir, family, cuda_graphs, force_flex, drafts_pay
):
    """float64 (the dense path; the same metadata, mask and score code as the kernel), with chunked prefill,
    a pool small enough to preempt, decode steps eager or through the graph buckets' padded buffers."""
    folder = mistral_dir if family == "mistral" else tiny_model_dirs[family]
    engine = Engine.from_pretrained(
        str(folder),
        dtype="float64",
        device="cpu",
        block_size=4,
        num_blocks=24,
        max_num_batched_tokens=11,
        max_num_seqs=5,
        cuda_graphs=cuda_graphs,
        **force_flex,
    )
    assert engine.runner.attention.name == "flex"
    prompts = _prompts(7, [1, 2, 7, 16, 17, 33, 50], engine.vocab_size) + [[21, 22, 23, 24] * 6]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(folder, prompts, 12)
    assert engine.stats.preemptions > 0
    if family != "mistral":  # (its answers never repeat their prompt: nothing to draft)
        assert engine.stats.draft_tokens > 0  # prompt-lookup drafts verified: several rows of one request
    if cuda_graphs:
        assert engine.runner.graphs.replays > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_flex_packed_logits_equal_unpacked(tiny_model_dir, force_flex):
    engine = Engine.from_pretrained(
        str(tiny_model_dir), dtype="float64", device="cpu", block_size=4, **force_flex
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    _assert_packed_logits(engine, hf, 1, 1e-9)


def _assert_packed_logits(engine, hf, seed, tol):
    """One packed forward of decode rows and prompt chunks (one of them after cached keys) gives each request
    the logits Hugging Face gives it alone."""
    prompts = _prompts(seed, [9, 1, 23, 5, 14], engine.vocab_size)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=4, temperature=0))
    reqs = list(engine.scheduler.waiting)
    for r, done in ((reqs[2], 10), (reqs[4], 13)):  # a chunk after cached keys, and a decode row
        assert engine.block_manager.allocate(r, done)
        engine.runner.execute(SchedulerOutput([r], [done]))
        r.num_computed_tokens = done
    for r in reqs:
        assert engine.block_manager.allocate(r, r.num_tokens)
    counts = [r.num_tokens - r.num_computed_tokens for r in reqs]
    input_ids, position_ids, meta, _ = engine.runner._prepare(SchedulerOutput(reqs, counts))
    assert meta.backend.name == "flex"
    with torch.inference_mode():
        packed = engine.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, batchjob_meta=meta
        ).logits[0]
        offset = 0
        for r, n in zip(reqs, counts, strict=True):
            alone = hf(torch.tensor([r.token_ids])).logits[0, -n:]
            torch.testing.assert_close(packed[offset : offset + n], alone, rtol=tol, atol=tol)
            offset += n


def test_compiled_flex_engine_equals_hf_and_compiles_once_per_kind(tiny_model_dir, force_flex):
    """float32 through the compiled kernel: HF generate's tokens; a second engine with another pool size and
    other step shapes compiles nothing new (batch, lengths, table width and pool size are dynamic)."""
    code = flex._paged_kernel.__code__
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
    kw = dict(
        dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24, max_num_seqs=5, **force_flex
    )
    engine = Engine.from_pretrained(str(tiny_model_dir), **kw)
    prompts = _prompts(8, [3, 40, 9, 17, 1], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert engine.runner.attention.state.compiled
    assert [o.token_ids for o in outs] == _hf_greedy(tiny_model_dir, prompts, 10, dtype=torch.float32)
    before = len(entries(code))
    other = Engine.from_pretrained(str(tiny_model_dir), num_blocks=77, **kw)
    prompts = _prompts(9, [60, 2, 31, 5, 12, 7], engine.vocab_size)
    other.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert other.runner.attention.state.compiled
    assert len(entries(code)) == before


# -- models that need flex: Gemma-2 (soft-capping, alternating windows), gpt-oss (sinks) ---------------------


def _tiny_family(folder, family):
    """A tiny random Gemma-2 or gpt-oss saved with a tokenizer (sinks drawn large enough to matter)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    common = dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )
    if family == "gemma2":
        cfg = Gemma2Config(
            attn_logit_softcapping=1.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16, **common
        )
    elif family == "gpt_oss":
        cfg = GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        cfg = BloomConfig(vocab_size=len(tok), hidden_size=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.5)
        if not cfg.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(folder))
    return folder


@engine_fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: _tiny_family(root / f, f) for f in ("gemma2", "gpt_oss", "bloom")}


# gpt-oss's experts run grouped matmuls that take no float64; its eager experts do.
_HF_LOAD = {
    "gemma2": {"attn_implementation": "eager"},
    "gpt_oss": {"attn_implementation": "eager", "experts_implementation": "eager"},
}


def _family_engine(folder, family, **kw):
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu", block_size=4, **kw)
    if family == "gpt_oss":
        engine.model.set_experts_implementation("eager")
    return engine


@pytest.mark.parametrize(("family", "feature"), [("gemma2", "softcap"), ("gpt_oss", "sinks")])
def test_models_needing_flex_choose_it_and_equal_hf(family_dirs, family, feature):
    folder = family_dirs[family]
    engine = _family_engine(folder, family, num_blocks=20, max_num_batched_tokens=9, max_num_seqs=4)
    assert {feature, "sliding_window"} <= engine.runner.features <= supported_features()
    assert engine.runner.attention.name == "flex"  # chosen, not forced
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **_HF_LOAD[family]).eval()
    prompts = _prompts(10, [1, 2, 7, 16, 17, 33, 45], engine.vocab_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(folder, prompts, 10, **_HF_LOAD[family])
    assert engine.stats.preemptions > 0
    # Gemma-2's eager attention takes its softmax in float32 even for a float64 model: so much agreement.
    tol = 1e-6 if family == "gemma2" else 1e-9
    _assert_packed_logits(_family_engine(folder, family), hf, 11, tol)


@pytest.mark.parametrize(("family", "feature"), [("gemma2", "softcap"), ("gpt_oss", "sinks")])
def test_backends_without_a_feature_refuse_the_model(family_dirs, family, feature):
    with pytest.raises(
        ConfigError, match=f"attention backend torch cannot run here: it does not implement.*{feature}"
    ):
        Engine.from_pretrained(
            str(family_dirs[family]), dtype="float64", device="cpu", attention_backend="torch"
        )


def test_bloom_alibi_is_refused_by_name_and_bypasses_the_attention_interface(family_dirs):
    """ALiBi is in the kernel (tested above) but not among the features flex claims: Bloom (like Falcon and MPT)
    computes attention inline and never calls the registered attention function, so no hook can serve it."""
    folder = family_dirs["bloom"]
    assert "alibi" in attention_features(AutoModelForCausalLM.from_pretrained(folder).config)
    assert "alibi" not in supported_features()
    with pytest.raises(ConfigError, match="model family 'bloom' computes attention inside its own layers"):
        Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    calls = []
    AttentionInterface.register("batchjob_probe", lambda *a, **k: calls.append(1))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    model.set_attn_implementation("batchjob_probe")
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]))
    assert calls == []


# -- one choice of backend and block size, for the engine and the job -----------------------------------------


@pytest.mark.parametrize("flash_installed", [False, True])
def test_choice_by_device_dtype_and_features(monkeypatch, flash_installed):
    monkeypatch.setattr(flash_backend, "installed", lambda: flash_installed)
    bf16 = torch.bfloat16
    fast = AttentionChoice("flash_attn", 256) if flash_installed else AttentionChoice("flex", 16)
    assert choose_attention(CUDA, bf16) == fast
    assert choose_attention(CUDA, bf16, frozenset({"sliding_window"})) == fast
    assert choose_attention(CUDA, bf16, block_size=16) == AttentionChoice("flex", 16)  # flash needs 256
    assert choose_attention(CUDA, bf16, frozenset({"softcap"})) == AttentionChoice("flex", 16)
    assert choose_attention(CUDA, torch.float32) == AttentionChoice("flex", 16)
    assert choose_attention(CPU, torch.float32).backend in ("cpu_kernel", "torch")
    assert choose_attention(CPU, torch.float32, frozenset({"sinks"})) == AttentionChoice("flex", 16)
    assert choose_attention(CPU, torch.bfloat16) == choose_attention(
        CPU, torch.float32
    )  # the kernel reads bf16 too
    with pytest.raises(ConfigError, match="no backend implements exactly: alibi"):
        choose_attention(CUDA, bf16, frozenset({"alibi"}))
    with pytest.raises(ConfigError, match="varlen cannot run here: it needs a CUDA device"):
        choose_attention(CPU, bf16, backend="varlen")
    with pytest.raises(ConfigError, match="multiple of 256 tokens, not 16"):
        choose_attention(CUDA, bf16, block_size=16, backend="varlen")
    if varlen_backend.Varlen.missing(CUDA, bf16) is None:
        assert choose_attention(CUDA, bf16, backend="varlen") == AttentionChoice("varlen", 256)
    else:  # torch 2.11's varlen_attn has no paged cache: refused by name, never a TypeError mid-job
        with pytest.raises(ConfigError, match="varlen_attn takes no block_table"):
            choose_attention(CUDA, bf16, backend="varlen")
    assert choose_attention(CUDA, bf16, backend="flex") == AttentionChoice("flex", 16)
    if flash_installed:
        assert choose_attention(CUDA, bf16, backend="flash") == AttentionChoice("flash_attn", 256)
    else:
        with pytest.raises(ConfigError, match="flash_attn cannot run here: flash-attn is not installed"):
            choose_attention(CUDA, bf16, backend="flash")
    with pytest.raises(ConfigError, match="must be one of auto, flash, varlen"):
        choose_attention(CPU, bf16, backend="nope")


@pytest.mark.parametrize("flash_installed", [False, True])
def test_job_path_on_cuda_chooses_what_the_engine_chooses(tiny_model_dir, monkeypatch, flash_installed):
    """The job carries no engine defaults of its own (block_size None): on a (simulated) CUDA device, the
    job's engine settings give the block size and backend an engine built with no options gets."""
    monkeypatch.setattr(flash_backend, "installed", lambda: flash_installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec = make_spec(device="cuda", kv_memory_gb=1.0)
    assert spec.engine.block_size is None
    expected = 256 if flash_installed else 16
    line = job_runner.check_engine(spec)  # what `batchjob validate` reports, from the model's config
    assert f"blocks x {expected} tokens" in line
    options = spec.engine.as_keywords()
    device = torch.device(options.pop("device"))
    job = EngineConfig(device=device, dtype=resolve_dtype(options.pop("dtype"), device), **options)
    engine = EngineConfig(device=CUDA, dtype=resolve_dtype("auto", CUDA))  # Engine.from_pretrained's defaults
    assert job.block_size == engine.block_size == expected
    features = attention_features(AutoModelForCausalLM.from_pretrained(tiny_model_dir).config)
    assert (
        choose_attention(CUDA, job.dtype, features, job.block_size)
        == choose_attention(CUDA, engine.dtype, features, engine.block_size)
        == AttentionChoice("flash_attn" if flash_installed else "flex", expected)
    )


# -- torch's varlen_attn: the metadata and call, checked on the CPU ------------------------------------------


def _varlen_in_torch(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False, seqused_k=None, block_table=None, return_aux=None, num_splits=None):  # fmt: skip
    """torch.nn.attention.varlen.varlen_attn's paged call written out (FA2: a right window of 0 is causal,
    bottom-right aligned; the left window counts keys before the query)."""
    assert block_table is not None and seqused_k is not None and window_size[1] == 0
    assert enable_gqa or q.shape[1] == k_cache.shape[2]
    for i in range(len(cu_q) - 1):  # seqused_k: the keys each request has, as cu_k says
        assert int(seqused_k[i]) == int(cu_k[i + 1] - cu_k[i])
    return _flash_varlen_in_torch(
        q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, softmax_scale=scale, window_size=window_size,
        block_table=block_table,
    )  # fmt: skip


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_varlen_metadata_equals_hf_generate(mistral_dir, monkeypatch, cuda_graphs):
    calls = []

    def varlen_attn(*args, **kwargs):
        calls.append(args[0].shape[0])
        return _varlen_in_torch(*args, **kwargs)

    monkeypatch.setattr(
        varlen_backend, "import_varlen", lambda: types.SimpleNamespace(varlen_attn=varlen_attn)
    )
    engine = Engine.from_pretrained(
        str(mistral_dir),
        dtype="float64",
        device="cpu",
        block_size=8,
        max_num_batched_tokens=24,
        cuda_graphs=cuda_graphs,
    )
    engine.runner.attention = engine.runner.new_backend("varlen")  # varlen runs on CUDA only: forced here
    prompts = _prompts(12, [1, 9, 40, 17], engine.vocab_size) + [[21, 22, 23, 24] * 6]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_greedy(mistral_dir, prompts, 12)
    assert calls
    if cuda_graphs:
        assert engine.runner.graphs.replays > 0
