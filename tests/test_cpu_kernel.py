"""The compiled CPU decode-attention kernel against torch's SDPA over gathered keys."""

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


@pytest.mark.engine  # the decode kernel over many shapes against SDPA: seconds, not the unit tier's inner loop
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
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
def test_kernel_equals_sdpa(dtype, heads, kv_heads, dim, block_size, window):
    gen = torch.Generator().manual_seed(heads * 100 + dim + window)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 300, 5, 129], dtype=torch.int64)
    max_blocks = int(-(-lens.max() // block_size))
    num_blocks = len(lens) * max_blocks + 3
    # Scattered blocks, as the block manager hands them out after some churn.
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen, dtype=dtype) * 3
    scale = dim**-0.5
    got = cpu_kernel.paged_decode(q, k_cache, v_cache, table, lens, scale, window or None)
    want = _reference(q, k_cache, v_cache, table, lens, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.engine  # runs the C++ compiler
@needs_kernel
def test_kernel_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is not None
        built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_kernel.load.cache_clear()
        assert cpu_kernel.load() is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("paged_decode-*.so")] == [mtime]
    finally:
        cpu_kernel.load.cache_clear()


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is None
    finally:
        cpu_kernel.load.cache_clear()
