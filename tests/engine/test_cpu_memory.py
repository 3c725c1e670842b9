"""The CPU's memory follows the job: a KV pool takes memory only for the blocks written, and packed
weights leave nothing of the checkpoint behind."""

from __future__ import annotations

import sys

import pytest
import torch

from batchjob.engine.cpu import linear as cpu_linear
from batchjob.engine.cpu.platform import CpuPlatform, lazy_zeros

pytestmark = pytest.mark.timeout(60)


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.engine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_the_kv_pool_takes_memory_only_where_written():
    before = _rss_mib()
    pool = lazy_zeros(256 << 20, torch.float32)  # 1 GiB of address space
    assert _rss_mib() - before < 64  # nothing taken at allocation
    assert pool.numel() == 256 << 20 and lazy_zeros(0, torch.bfloat16).numel() == 0
    assert not pool[:1024].any() and not pool[-1024:].any()  # zeroed (the OS zeroes pages on first touch)
    pool[: 8 << 20].fill_(1.0)  # 32 MiB written
    grown = _rss_mib() - before
    assert 28 < grown < 96, grown
    del pool


@pytest.mark.engine
def test_the_cpu_platform_pool_is_zeroed_views_of_one_growing_pool():
    platform = CpuPlatform(torch.device("cpu"), spin_guard=False)
    assert platform.grows_kv
    kv = platform.allocate_kv((4, 16, 2, 8), 3, torch.bfloat16)
    assert len(kv) == 3 and all(k.shape == v.shape == (4, 16, 2, 8) for k, v in kv)
    assert all(not k.any() and not v.any() and k.dtype == torch.bfloat16 for k, v in kv)
    kv[0][1].fill_(1)
    assert not kv[0][0].any() and not kv[1][0].any()  # distinct views


def test_packing_gives_what_stays_unpacked_its_own_memory():
    """A checkpoint loaded as views of one mapping (here one buffer) is released once its linears are packed:
    the embedding and biases left unpacked are copied out, values unchanged, tying kept."""
    torch.manual_seed(0)
    blob = torch.randn(50 * 32 + 32 * 32 + 32)
    embed = torch.nn.Embedding(50, 32)
    embed.weight = torch.nn.Parameter(blob[: 50 * 32].view(50, 32), requires_grad=False)
    own = torch.nn.Linear(32, 32)
    own.weight = torch.nn.Parameter(blob[50 * 32 : 50 * 32 + 1024].view(32, 32), requires_grad=False)
    own.bias = torch.nn.Parameter(blob[-32:], requires_grad=False)
    head = torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight  # tied
    model = torch.nn.ModuleDict({"embed": embed, "own": own, "head": head})
    x = torch.randn(3, 32)
    want = head(own(x))
    keep = embed.weight.clone()
    assert cpu_linear.prepack_linears(model) == 2
    span = range(blob.data_ptr(), blob.data_ptr() + blob.numel() * 4)
    assert embed.weight.data_ptr() not in span and own.bias.data_ptr() not in span
    assert head.weight is embed.weight and torch.equal(embed.weight, keep)
    torch.testing.assert_close(head(own(x)), want, atol=1e-5, rtol=1e-5)


_FAULTS_OF_A_LAYER = """
import resource, sys, torch
from batchjob.engine.cpu import heap
def layer():  # a prompt chunk's MLP buffers: four of 5 MiB live at once, then freed
    bufs = [torch.empty(5 << 20, dtype=torch.uint8).fill_(1) for _ in range(4)]
    del bufs
def faults():
    for _ in range(3):  # the first rounds grow the heap to its size: not counted
        layer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        layer()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# glibc's own thresholds move with what was freed before, so whether a buffer goes back to the OS depends on
# the heap's history; small fixed ones make every 5 MiB buffer an mmap of its own, as at a cold start.
import ctypes
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-3, 128 << 10) and libc.mallopt(-1, 128 << 10)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
plain = faults()
assert heap.keep_freed_memory()
print(plain, faults())
"""


@pytest.mark.process
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, faults from getrusage")
def test_freed_buffers_stay_in_the_heap_without_page_faults():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_OF_A_LAYER], capture_output=True, text=True, check=True, timeout=50
    ).stdout.split()
    plain, kept = int(out[0]), int(out[1])
    assert plain > 20 * 4 * 1000, plain  # each layer's buffers fault in again (1,280 pages of 4 KiB each)
    assert kept < plain // 50, (plain, kept)
