"""The compiled CPU attention kernels (decode; bf16 prompt chunks) against torch's SDPA over gathered keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.engine.cpu import kernel as cpu_kernel

needs_kernel = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C++ compiler on this machine")


def _reference(q, k_cache, v_cache, table, lens, scale, window):
    """Each request alone: gather its keys, mask the window, SDPA with the query heads grouped."""
    out = torch.empty_like(q)
    kv_heads = k_cache.shape[2]
    for g in range(q.shape[0]):
        n = int(lens[g])
        k = k_cache[table[g]].reshape(-1, kv_heads, k_cache.shape[3])[:n].transpose(0, 1)
        v = v_cache[table[g]].reshape(-1, kv_heads, v_cache.shape[3])[:n].transpose(0, 1)
        rep = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        mask = torch.ones(n, dtype=torch.bool)
        if window:
            mask[: max(0, n - window)] = False
        out[g] = F.scaled_dot_product_attention(q[g][:, None], k, v, attn_mask=mask[None, None], scale=scale)[
            :, 0
        ]
    return out


SHAPES = (
    ("heads", "kv_heads", "dim", "block_size", "window"),
    [
        (9, 3, 64, 16, 0),
        (4, 2, 16, 4, 0),
        (8, 8, 128, 16, 0),
        (6, 1, 80, 8, 0),
        (4, 2, 16, 4, 6),
        (9, 3, 64, 16, 37),
    ],
)


def _scattered_case(heads, kv_heads, dim, block_size, lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = int(-(-lens.max() // block_size))
    num_blocks = len(lens) * max_blocks + 3
    # Scattered blocks, as the block manager hands them out after some churn.
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    q = (torch.randn(len(lens), heads, dim, generator=gen) * 3).to(dtype)
    return q, k_cache, v_cache, table


@pytest.mark.engine  # the decode kernel over many shapes against SDPA: seconds, not the unit tier's inner loop
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(*SHAPES)
def test_kernel_equals_sdpa(dtype, heads, kv_heads, dim, block_size, window):
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 300, 5, 129], dtype=torch.int64)
    seed = heads * 100 + dim + window
    q, k_cache, v_cache, table = _scattered_case(heads, kv_heads, dim, block_size, lens, dtype, seed)
    scale = dim**-0.5
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, table, lens, scale, window or None)
    want = _reference(q, k_cache, v_cache, table, lens, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.engine  # the decode kernel over many shapes: seconds, not the unit tier's inner loop
@needs_kernel
@pytest.mark.parametrize(*SHAPES)
def test_bf16_kernel_equals_float32_reference_up_to_output_rounding(heads, kv_heads, dim, block_size, window):
    """bf16 in, bf16 out, float inside: the kernel's output is the float32 reference over the same bf16
    inputs, rounded once to bf16. Every element is within half a bf16 step of the reference (plus float
    summation-order noise), and nearly all are exactly its rounding."""
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 300, 5, 129, 1000], dtype=torch.int64)
    q, k_cache, v_cache, table = _scattered_case(
        heads, kv_heads, dim, block_size, lens, torch.bfloat16, dim + window
    )
    scale = dim**-0.5
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, table, lens, scale, window or None)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = _reference(q.float(), k_cache.float(), v_cache.float(), table, lens, scale, window)
    # bf16 keeps 8 significant bits: rounding moves x = m * 2^e (0.5 <= |m| < 1) by at most 2^(e - 9).
    half_step = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 9)
    assert ((got.float() - want).abs() <= half_step * (1 + 1e-4) + 1e-6).all()
    exact = (got == want.to(torch.bfloat16)).float().mean().item()
    assert exact > 0.99, exact  # the rest sit within float noise of a rounding boundary


@pytest.mark.engine  # runs the C++ compiler
@needs_kernel
def test_bf16_kernel_rounds_to_nearest_even_and_keeps_nan_inf():
    """One key: the output is that key's value, so the store's rounding and special values show exactly."""
    v = torch.tensor([1.0, -2.5, float("inf"), float("-inf"), float("nan"), 3.0e38, 1e-40, 0.0])
    k_cache = torch.zeros(1, 1, 1, len(v), dtype=torch.bfloat16)
    v_cache = v.to(torch.bfloat16).view(1, 1, 1, -1)
    q = torch.zeros(1, 1, len(v), dtype=torch.bfloat16)
    one = torch.tensor([1], dtype=torch.int64)
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int64), one, 1.0, None)
    torch.testing.assert_close(got[0, 0], v_cache[0, 0, 0], equal_nan=True, atol=0, rtol=0)


def _needs_prefill_kernel(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cpu_kernel.prefill_takes(dtype, 64):
        pytest.skip(
            "the bf16 prefill kernel needs AVX512-BF16 (avx512_bf16 in /proc/cpuinfo) and a C++ compiler"
            if dtype == torch.bfloat16
            else "the prefill kernels need a C++ compiler"
        )


PREFILL_DTYPES = [torch.bfloat16, torch.float32]
# closeness to float64 attention of the same inputs: bf16 within its rounding, float32 within float's
PREFILL_TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float32: dict(atol=5e-5, rtol=1e-5)}


def _key_ends(chunks, starts, total) -> torch.Tensor:
    """[total] per row past the last key it sees: itself, but the middle third of each chunk of 3 rows or
    more sees to that third's end (an image's tokens attending both ways)."""
    ends = torch.zeros(total, dtype=torch.int64)
    for (n, ctx), start in zip(chunks, starts, strict=True):
        pos = torch.arange(ctx - n, ctx)
        ends[start : start + n] = pos + 1
        a, b = ctx - n + n // 3, ctx - n + 2 * n // 3
        if n >= 3:
            ends[start : start + n][(pos >= a) & (pos < b)] = b
    return ends


@pytest.mark.engine  # runs the C++ compiler
@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("bounds", ["causal", "window", "key_ends"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(14, 2, 64, 16), (12, 2, 128, 16), (6, 1, 80, 8), (4, 4, 16, 4), (9, 3, 96, 16)],
)
def test_prefill_kernel_equals_float64_attention_up_to_rounding(
    heads, kv_heads, dim, block_size, bounds, dtype
):
    """Prompt chunks of a step (a whole prompt, a chunk continuing cached keys, one row, rows of other
    requests between them left alone) over scattered blocks, against float64 attention of the same inputs:
    causal, within a window of 24 keys, or with rows that see past themselves (``key_ends``) and the window.
    In bf16 the kernel rounds the probabilities to bf16 before the second product, as torch's flash
    attention does: its error is that of SDPA in the same dtype, element by element and on average."""
    _needs_prefill_kernel(dtype)
    chunks = [(37, 37), (20, 90), (1, 5), (1, 1), (64, 64), (17, 300)]  # (rows, keys)
    gaps = [0, 3, 0, 2, 1, 0]  # rows of other requests before each chunk: left as they are
    lens = torch.tensor([ctx for _, ctx in chunks], dtype=torch.int64)
    _, k_cache, v_cache, table = _scattered_case(heads, kv_heads, dim, block_size, lens, dtype, dim)
    starts, row = [], 0
    for (n, _), gap in zip(chunks, gaps, strict=True):
        starts.append(row + gap)
        row += gap + n
    gen = torch.Generator().manual_seed(heads)
    q = (torch.randn(row, heads, dim, generator=gen) * 2).to(dtype).transpose(0, 1)  # [H, T, D]
    out = torch.full((row, heads, dim), 7.0, dtype=dtype)
    q_lens = torch.tensor([n for n, _ in chunks], dtype=torch.int64)
    window = None if bounds == "causal" else 24
    key_ends = _key_ends(chunks, starts, row) if bounds == "key_ends" else None
    cpu_kernel.paged_prefill(
        q, k_cache, v_cache, table, torch.tensor(starts), q_lens, lens, dim**-0.5, out, window, key_ends
    )

    rep = heads // kv_heads
    got, want, sdpa_bf16 = [], [], []
    for (n, ctx), start, blocks in zip(chunks, starts, table, strict=True):
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1).repeat_interleave(rep, 0)
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].transpose(0, 1).repeat_interleave(rep, 0)
        qc = q[:, start : start + n]
        kpos, qpos = torch.arange(ctx)[None, :], torch.arange(ctx - n, ctx)[:, None]
        ends = qpos + 1 if key_ends is None else key_ends[start : start + n, None]
        mask = (kpos < ends) & (kpos > qpos - (window or ctx))  # bottom-right causal, or to each row's end
        exact = F.scaled_dot_product_attention(
            qc.double(), k.double(), v.double(), attn_mask=mask, scale=dim**-0.5
        )
        plain = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=dim**-0.5)
        got.append(out[start : start + n].transpose(0, 1).double())
        want.append(exact)
        sdpa_bf16.append(plain.double())
    got_t, want_t, sdpa_t = torch.cat(got, 1), torch.cat(want, 1), torch.cat(sdpa_bf16, 1)
    torch.testing.assert_close(got_t, want_t, **PREFILL_TOLERANCE[dtype])
    assert (got_t - want_t).abs().mean() <= 1.25 * (sdpa_t - want_t).abs().mean()
    untouched = torch.ones(row, dtype=torch.bool)
    for start, (n, _) in zip(starts, chunks, strict=True):
        untouched[start : start + n] = False
    assert untouched.sum() == sum(gaps) and (out[untouched] == 7.0).all()


@pytest.mark.engine  # runs the C++ compiler
@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 12, 32), (12, 12, 64), (14, 2, 64), (6, 3, 80)])
def test_dense_prefill_equals_float64_attention_up_to_rounding(heads, kv_heads, dim, causal, window, dtype):
    """Sequences attended over their own keys (an encoder's rows, a vision tower's images): q, k and v as
    the column views of one projection that transformers' attention layers pass, each sequence both ways
    (or causal), without a window or within 24 keys (on either side both ways), against float64 attention
    of the same inputs, within SDPA's own error in that dtype."""
    _needs_prefill_kernel(dtype)
    lens = [197, 1, 16, 60, 257]
    total, gen = sum(lens), torch.Generator().manual_seed(dim)
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(total, width, generator=gen) * 2).to(dtype)  # one product, q k v columns
    q = qkv[:, : heads * dim].view(total, heads, dim).transpose(0, 1)  # [H, T, D], strided
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(total, kv_heads, dim).transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim).transpose(0, 1)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    out = torch.empty(total, heads, dim, dtype=dtype)
    cpu_kernel.dense_prefill(q, k, v, starts, torch.tensor(lens), dim**-0.5, causal, out, window)

    rep = heads // kv_heads
    got, want, sdpa_bf16 = [], [], []
    for start, n in zip(starts.tolist(), lens, strict=True):
        qc = q[:, start : start + n]
        kc, vc = (x[:, start : start + n].repeat_interleave(rep, 0) for x in (k, v))
        gap = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # key position less query position
        mask = ((gap <= 0) if causal else (gap < (window or n))) & (gap > -(window or n))
        exact = F.scaled_dot_product_attention(qc.double(), kc.double(), vc.double(), mask, scale=dim**-0.5)
        sdpa_bf16.append(F.scaled_dot_product_attention(qc, kc, vc, mask, scale=dim**-0.5).double())
        got.append(out[start : start + n].transpose(0, 1).double())
        want.append(exact)
    got_t, want_t, sdpa_t = torch.cat(got, 1), torch.cat(want, 1), torch.cat(sdpa_bf16, 1)
    torch.testing.assert_close(got_t, want_t, **PREFILL_TOLERANCE[dtype])
    assert (got_t - want_t).abs().mean() <= 1.25 * (sdpa_t - want_t).abs().mean()


def bf16_prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 80, (24,), generator=gen)
    return [torch.randint(3, vocab_size - 8, (int(n),), generator=gen).tolist() for n in lengths]


def assert_bf16_differs_only_at_near_ties(folder, prompts, got, want, what: str, capsys) -> None:
    """Two bf16 runs of one model that round differently can pick differently where two logits are within
    bf16 rounding of each other. Each sequence agrees up to its first difference, that difference falls on a
    near-tie of the float32 model's logits (top two within two bf16 steps of the top logit) with both picks
    the two, most tokens agree, and the agreement rate is printed."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    same = total = diverged = 0
    for prompt, out, expected in zip(prompts, got, want, strict=True):
        assert len(out) == len(expected) > 0
        total += len(expected)
        first = next((i for i, (a, b) in enumerate(zip(out, expected, strict=True)) if a != b), None)
        same += len(expected) if first is None else first
        if first is None:
            continue
        diverged += 1
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + expected[:first]])).logits[0, -1]
        top2 = logits.topk(2)
        step = 2.0 ** (torch.frexp(top2.values[0]).exponent.item() - 8)  # one bf16 step at the top logit
        assert float(top2.values[0] - top2.values[1]) < 2 * step, (prompt, first, top2)
        assert {out[first], expected[first]} <= set(top2.indices.tolist()), (prompt, first, top2)
    with capsys.disabled():
        print(
            f"\nbf16 engine, {what}: {same}/{total} tokens agree before any first difference; "
            f"{diverged}/{len(prompts)} sequences differ, each from a near-tie"
        )
    assert same >= 0.6 * total  # measured here: 624/768 kernel vs reference (a gross error agrees on few)


@needs_kernel
@pytest.mark.parametrize("step_tokens", [None, 24])
def test_engine_in_bf16_decodes_with_the_kernel_and_differs_from_the_reference_only_at_near_ties(
    decisive_model_dir, capsys, step_tokens
):
    """The engine in bf16 chooses the kernel; its greedy tokens against the torch reference's (same bf16
    weights and cache), which rounds attention differently (float inside the kernel, bf16 SDPA outside).
    With AVX512-BF16 the prompt chunks go to the prefill kernel too; at 24 tokens a step, chunks continue
    over keys cached by earlier steps and share steps with decoding rows."""
    from batchjob import Engine, SamplingParams

    options = dict(dtype="bfloat16", device="cpu", num_blocks=128, max_num_batched_tokens=step_tokens)
    kern = Engine.from_pretrained(str(decisive_model_dir), **options)
    assert kern.runner.attention.name == "cpu_kernel"  # auto: the kernel takes bf16
    head_dim = kern.runner.attention.kv_caches[0][0].shape[3]
    assert kern.runner.attention.prefill_kernel == cpu_kernel.prefill_takes(torch.bfloat16, head_dim)
    ref = Engine.from_pretrained(str(decisive_model_dir), attention_backend="torch", **options)
    prompts = bf16_prompts(kern.vocab_size)
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in kern.generate(prompts, params)]
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert all(len(t) == 32 for t in got + want)
    what = f"kernel vs reference, {step_tokens or 'default'} tokens a step"
    assert_bf16_differs_only_at_near_ties(decisive_model_dir, prompts, got, want, what, capsys)


@pytest.mark.engine  # builds and loads a model
def test_windowed_layers_attend_on_the_prefill_kernel(tmp_path):
    """Gemma 3 (a windowed layer of 16 keys, then a full layer), float32: prompts within the window and
    past it, one step each, attend on the prefill kernel in both layers; greedy tokens equal float64's and
    their log-probabilities agree within float32's rounding (1e-4)."""
    from batchjob import Engine, SamplingParams
    from tests.tiny_models import make_family_model, random_prompts

    _needs_prefill_kernel(torch.float32)
    folder = make_family_model(tmp_path / "gemma3", "gemma3_text", sliding_window=16)
    engine = Engine.from_pretrained(str(folder), device="cpu", dtype="float32")
    exact = Engine.from_pretrained(str(folder), device="cpu", dtype="float64")
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    calls: list[int | None] = []
    plain = cpu_kernel.paged_prefill
    try:
        cpu_kernel.paged_prefill = lambda *a, **k: calls.append(a[9]) or plain(*a, **k)
        for lengths in ([12, 16], [100, 30]):
            calls.clear()
            prompts = random_prompts(lengths, engine.vocab_size, seed=max(lengths))
            got = engine.generate(prompts, params)
            assert calls == [16, None]  # the prompts' one step: the windowed layer, then the full one
            for out, want in zip(got, exact.generate(prompts, params), strict=True):
                assert out.token_ids == want.token_ids
                lp = [top[0][1] for top in out.logprobs]
                assert lp == pytest.approx([top[0][1] for top in want.logprobs], abs=1e-4)
    finally:
        cpu_kernel.paged_prefill = plain


@pytest.mark.engine  # runs the C++ compiler
@needs_kernel
def test_kernel_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is not None
        built = list((tmp_path / "kernels").glob("paged_attention-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_kernel.load.cache_clear()
        assert cpu_kernel.load() is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("paged_attention-*.so")] == [mtime]
    finally:
        cpu_kernel.load.cache_clear()


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is None
    finally:
        cpu_kernel.load.cache_clear()


@pytest.mark.engine  # builds and loads a model
@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("family", ["bert", "gemma3"])
def test_encoder_rows_go_to_the_prefill_kernel_within_sdpas_error(tmp_path, family, dtype):
    """An embedder's rows in bf16 or float32, attended both ways: every layer goes to the prefill kernel over
    the step's own keys (EmbeddingGemma's windowed ones within their window both ways). Against float64
    embeddings of the same model, the kernel's are as close as the SDPA path's (same weights, same engine)."""
    from batchjob import Engine
    from tests.task_models import make_embedder

    _needs_prefill_kernel(dtype)
    folder = make_embedder(tmp_path / family, family, "mean", normalize=False)
    gen = torch.Generator().manual_seed(1)
    texts = [torch.randint(5, 400, (n,), generator=gen).tolist() for n in (3, 40, 17, 90)]  # token ids
    engine = Engine.from_pretrained(str(folder), device="cpu", dtype=dtype, task="embed")
    attention = engine.runner.attention
    assert attention.name == "cpu_kernel" and attention.prefill_kernel
    calls = []
    plain = cpu_kernel.dense_prefill
    try:
        cpu_kernel.dense_prefill = lambda *a, **k: calls.append(a[3].numel()) or plain(*a, **k)
        outs = engine.embed(texts)
    finally:
        cpu_kernel.dense_prefill = plain
    assert all(o.error is None for o in outs), [o.error for o in outs]
    got = torch.stack([torch.from_numpy(o.embedding).double() for o in outs])
    layers = 2 if family == "bert" else 4  # EmbeddingGemma's three windowed layers (4 keys each way) too
    assert len(calls) == layers and sum(calls) == layers * len(texts)  # one call a layer, every row in it
    attention.prefill_kernel = False
    sdpa = torch.stack([torch.from_numpy(o.embedding).double() for o in engine.embed(texts)])
    exact = Engine.from_pretrained(str(folder), device="cpu", dtype="float64", task="embed")
    want = torch.stack([torch.from_numpy(o.embedding) for o in exact.embed(texts)])
    err, sdpa_err = (got - want).abs().mean(), (sdpa - want).abs().mean()
    assert err <= 1.25 * sdpa_err, (err, sdpa_err)
    assert F.cosine_similarity(got, want).min() > 0.999


@pytest.mark.engine  # builds a model
@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("heads", [4, 1])
def test_vision_tower_attention_on_the_prefill_kernel_within_sdpas_error(heads, dtype):
    """A CLIP vision tower in bf16 or float32 with the kernel's attention (head size 16 or 64): its hidden states
    against float64 as close as with transformers' SDPA; a call with a mask is SDPA's, bit for bit."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from batchjob.engine.cpu import tower

    _needs_prefill_kernel(dtype)
    config = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        image_size=64,
        patch_size=8,
    )
    torch.manual_seed(0)
    model = CLIPVisionModel(config).eval()
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))

    def hidden(dtype, attn):
        model.to(dtype).set_attn_implementation(attn)
        with torch.inference_mode():
            return model(pixel_values=pixels.to(dtype)).last_hidden_state.double()

    want = hidden(torch.float64, "sdpa")
    sdpa = hidden(dtype, "sdpa")
    calls = []
    plain = cpu_kernel.dense_prefill
    try:
        cpu_kernel.dense_prefill = lambda *a, **k: calls.append(a[3].numel()) or plain(*a, **k)
        got = hidden(dtype, tower.TOWER_ATTN)
    finally:
        cpu_kernel.dense_prefill = plain
    assert calls == [3, 3]  # one call a layer, the three images in it
    err, sdpa_err = (got - want).abs().mean(), (sdpa - want).abs().mean()
    assert err <= 1.25 * sdpa_err, (err, sdpa_err)

    layer = next(m for m in model.modules() if type(m).__name__ == "CLIPAttention")
    q = torch.randn(2, heads, 65, 64 // heads, dtype=dtype)
    mask = torch.zeros(2, 1, 65, 65, dtype=dtype)
    mask[..., 60:] = float("-inf")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masked, _ = tower.tower_attention(layer, q, q, q, mask)
    reference, _ = sdpa_attention_forward(layer, q, q, q, mask)
    assert torch.equal(masked, reference)


@pytest.mark.engine  # builds and loads a model
def test_an_engine_gives_its_vision_tower_the_kernels_attention_in_float32_and_bf16_not_float64(tmp_path):
    from batchjob import Engine
    from batchjob.engine.cpu import tower
    from tests.vision_models import make_llava

    _needs_prefill_kernel(torch.float32)
    folder = make_llava(tmp_path / "llava")
    cases = [("float32", tower.TOWER_ATTN), ("float64", "sdpa")]
    if cpu_kernel.prefill_takes(torch.bfloat16, 64):
        cases.append(("bfloat16", tower.TOWER_ATTN))
    for dtype, expected in cases:
        model = Engine.from_pretrained(str(folder), device="cpu", dtype=dtype).runner.model
        assert model.config.vision_config._attn_implementation == expected
        assert model.config.text_config._attn_implementation != expected


@pytest.mark.engine  # runs the C++ compiler
def test_float32_prefill_kernel_built_for_avx2_equals_float64_attention(tmp_path):
    """The float32 kernel's AVX2 form (8 floats a vector, 12 rows a task), which a CPU without AVX-512 runs:
    built here for x86-64-v3 and called as the engine calls the native build, causal and both ways, with and
    without a window, at head sizes of 32 to 128 and grouped queries, against float64 attention."""
    import ctypes
    import platform
    import shutil
    import subprocess

    _needs_prefill_kernel(torch.float32)
    cxx = shutil.which("g++")
    if platform.machine() not in ("x86_64", "AMD64") or cxx is None:
        pytest.skip("builds the x86-64-v3 (AVX2) form with g++ on an x86-64 CPU")
    flags = [f for f in cpu_kernel.FLAGS if f != "-march=native"] + ["-march=x86-64-v3"]
    target = tmp_path / "avx2.so"
    sources = [str(s) for s in cpu_kernel.SOURCES]
    subprocess.run([cxx, *flags, *sources, "-o", str(target)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    native = cpu_kernel.load()
    assert native is not None
    fn = lib.batchjob_prefill_f32
    fn.argtypes, fn.restype = native.batchjob_prefill_f32.argtypes, ctypes.c_int
    gen = torch.Generator().manual_seed(3)
    for seqs, length, heads, kv_heads, dim, causal, window in [
        (3, 197, 12, 12, 64, False, 0),
        (2, 100, 14, 2, 64, True, 0),
        (5, 37, 12, 12, 32, False, 16),
        (2, 50, 6, 3, 80, True, 0),
        (1, 300, 12, 2, 128, True, 64),
    ]:
        total = seqs * length
        x = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen)
        q = x[:, : heads * dim].view(total, heads, dim).transpose(0, 1)
        k = x[:, heads * dim : (heads + kv_heads) * dim].view(total, kv_heads, dim).transpose(0, 1)
        v = x[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim).transpose(0, 1)
        starts, lens = torch.arange(seqs) * length, torch.full((seqs,), length)
        out = torch.empty(total, heads, dim)
        strides = [a for t in (q, k, v) for a in (t.data_ptr(), t.stride(0), t.stride(1))]
        pointers = (starts.data_ptr(), lens.data_ptr(), lens.data_ptr())
        assert (
            fn(
                *strides,
                0,
                0,
                1,
                *pointers,
                seqs,
                heads,
                kv_heads,
                dim,
                dim**-0.5,
                int(causal),
                window,
                None,
                out.data_ptr(),
            )
            == 0
        )
        rep = heads // kv_heads
        gap = torch.arange(length)[None, :] - torch.arange(length)[:, None]  # key position less query's
        mask = ((gap <= 0) if causal else (gap < (window or length))) & (gap > -(window or length))
        for start in starts.tolist():
            rows = slice(start, start + length)
            kc, vc = (t[:, rows].double().repeat_interleave(rep, 0) for t in (k, v))
            want = F.scaled_dot_product_attention(q[:, rows].double(), kc, vc, mask)
            torch.testing.assert_close(
                out[rows].double(), want.transpose(0, 1), **PREFILL_TOLERANCE[torch.float32]
            )
