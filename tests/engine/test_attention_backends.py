"""The attention backend contract: every backend, through the same hook and the same inputs, against one
written-out reference.

One packed step of mixed work (one-token decodes of short and long contexts, prompt chunks with and without
cached keys, a chunk reaching past several windows, a draft verification, two requests sharing pages) goes
through ``paged_attention`` with each backend's own metadata (built from the backend-neutral layout, and for
the decode rows also from graph-bucket buffers). Each backend that can run here runs for real; flash-attn and
torch's varlen, which need CUDA, run their metadata through torch renderings of their kernels on the CPU and
are run for real where a GPU is (``pytest -m gpu``), so a first GPU session can fix one backend at a time.
What a backend declares (features, devices, dtypes, block sizes) is checked against what it does.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from batchjob.engine import attention
from batchjob.engine.attention import AttentionMetadata, Packer, StepLayout
from batchjob.engine.attention import varlen as varlen_module
from batchjob.engine.attention.registry import OPTION_CHOICES, REGISTRY, choose_attention, supported_features
from batchjob.engine.options import ATTENTION_BACKENDS
from batchjob.errors import ConfigError
from tests.engine.test_flex import _varlen_in_torch
from tests.engine.test_graphs import _flash_varlen_in_torch

pytestmark = pytest.mark.timeout(300)

HEADS, KV_HEADS, DIM = 6, 2, 16
# (context after the step, rows this step, drafts among them)
REQUESTS = [
    (37, 1, 0),
    (45, 12, 0),
    (1, 1, 0),
    (16, 16, 0),
    (70, 1, 0),
    (33, 9, 0),
    (5, 5, 0),
    (100, 31, 0),
    (17, 1, 0),
    (52, 4, 3),  # a draft verification: 3 drafts and the token before them
]
DECODES = [(37, 1, 0), (1, 1, 0), (70, 1, 0), (17, 1, 0), (9, 1, 0)]
# (window, softcap, ALiBi, sinks): the cases; a backend runs those whose features it applies.
CASES = {
    "plain": (None, None, False, False),
    "window": (5, None, False, False),
    "softcap": (None, 2.0, False, False),
    "alibi_sinks_window": (6, None, True, True),
}
CUDA = torch.cuda.is_available()


class _Step:
    """A paged cache holding each request's earlier keys, its new keys, and the queries, on ``device``."""

    def __init__(self, requests, block_size, dtype, device, seed=0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests, self.block_size = requests, block_size
        num_blocks = sum(-(-ctx // block_size) for ctx, _, _ in requests) + 8
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.keys, self.values, tables = [], [], []
        for i, (ctx, n, _) in enumerate(requests):
            k = torch.randn(ctx, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
            v = torch.randn(ctx, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
            shared: list[int] = []
            if i == 1:  # request 1 holds request 0's first full pages (a shared prefix): the same keys
                ctx0, n0, _ = requests[0]
                full = min(ctx0 - n0, ctx - n) // block_size
                shared = tables[0][:full]
                k[: full * block_size] = self.keys[0][: full * block_size]
                v[: full * block_size] = self.values[0][: full * block_size]
            tables.append(shared + [free.pop() for _ in range(-(-ctx // block_size) - len(shared))])
            self.keys.append(k)
            self.values.append(v)
        self.tables = tables
        k_cache = torch.zeros(num_blocks, block_size, KV_HEADS, DIM, dtype=torch.float64)
        v_cache = torch.zeros_like(k_cache)
        new_k, new_v = [], []
        for (ctx, n, _), t, k, v in zip(requests, tables, self.keys, self.values, strict=True):
            for p in range(ctx - n):  # earlier keys are in the cache; the new ones come with the step
                k_cache[t[p // block_size], p % block_size] = k[p]
                v_cache[t[p // block_size], p % block_size] = v[p]
            new_k.append(k[ctx - n :])
            new_v.append(v[ctx - n :])
        total = sum(n for _, n, _ in requests)
        self.q = torch.randn(HEADS, total, DIM, generator=gen, dtype=torch.float64)
        self.key = torch.cat(new_k).transpose(0, 1)[None]  # [1, KVH, T, D]
        self.value = torch.cat(new_v).transpose(0, 1)[None]
        self.kv = [(k_cache.to(device, dtype), v_cache.to(device, dtype))]
        self.dtype, self.device = dtype, device

    def layout(self) -> StepLayout:
        bs = self.block_size
        n = np.array([r[1] for r in self.requests], dtype=np.int64)
        ends = np.array([r[0] for r in self.requests], dtype=np.int64)
        starts = ends - n
        offsets = np.concatenate([[0], np.cumsum(n)])
        table = np.zeros((len(self.tables), max(map(len, self.tables))), dtype=np.int64)
        for i, t in enumerate(self.tables):
            table[i, : len(t)] = t
        req_of_row = np.repeat(np.arange(len(n)), n)
        positions = np.arange(int(n.sum())) - np.repeat(offsets[:-1] - starts, n)
        slots = table[req_of_row, positions // bs] * bs + positions % bs
        drafts = np.array([r[2] for r in self.requests], dtype=np.int64)
        zeros = np.zeros(0, dtype=np.int64)
        return StepLayout(
            zeros, positions, slots, table, req_of_row, starts, n, ends, offsets, drafts, n > 0, zeros
        )

    def metadata(self, backend, graph: bool) -> AttentionMetadata:
        lay = self.layout()
        if graph:  # a graph bucket's buffers: every row one query (decodes only)
            dev = self.device
            slots = torch.from_numpy(lay.slots).to(dev)
            table = torch.from_numpy(lay.table).to(dev)
            lens = torch.from_numpy(lay.ends).to(dev)
            return AttentionMetadata(self.kv, slots, backend, backend.decode_metadata(slots, table, lens))
        pk = Packer()
        h_slots = pk.add(lay.slots)
        handles = backend.pack(lay, pk)
        buf = pk.send(self.device)
        return AttentionMetadata(self.kv, pk.view(buf, h_slots), backend, backend.metadata(handles, buf))

    def reference(self, scale, window, softcap, slopes, sinks) -> torch.Tensor:
        """Each request alone, written out in float64; [T, H, D]."""
        out = []
        g = HEADS // KV_HEADS
        row = 0
        for (ctx, n, _), k, v in zip(self.requests, self.keys, self.values, strict=True):
            q = self.q[:, row : row + n]
            s = torch.einsum("hnd,khd->hnk", q, k.repeat_interleave(g, 1)) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            qpos, kpos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
            if slopes is not None:
                s = s + slopes.double()[:, None, None] * (kpos - qpos)
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            s = s.masked_fill(~mask, -math.inf)
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None, None].expand(HEADS, n, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :ctx]
            out.append(torch.einsum("hnk,khd->nhd", p, v.repeat_interleave(g, 1)))
            row += n
        return torch.cat(out)


def _rendered(monkeypatch, name: str) -> None:
    """flash-attn and torch's varlen kernels, which need CUDA, rendered in torch (test_graphs, test_flex)."""
    if name == "flash_attn":
        monkeypatch.setitem(
            sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_flash_varlen_in_torch)
        )
    else:
        monkeypatch.setattr(
            varlen_module, "import_varlen", lambda: types.SimpleNamespace(varlen_attn=_varlen_in_torch)
        )


def _configs():
    """(backend, device, dtype, block size, rendered) for each run: float64 where a backend takes it, and the
    CPU kernel in bf16 too."""
    out = []
    for name, cls in REGISTRY.items():
        for dev in ("cpu", "cuda"):
            device = torch.device(dev)
            marks = [pytest.mark.gpu] if dev == "cuda" else []
            if cls.unusable(device, torch.float64) is None:
                out.append(
                    pytest.param(name, dev, torch.float64, 4, False, marks=marks, id=f"{name}-{dev}-f64")
                )
            elif dev == "cpu" and name in ("flash_attn", "varlen"):
                out.append(pytest.param(name, dev, torch.float64, 4, True, id=f"{name}-cpu-rendered"))
            elif dev == "cuda" and cls.devices == ("cuda",):
                bs = cls.default_block_size
                out.append(
                    pytest.param(name, dev, torch.bfloat16, bs, False, marks=marks, id=f"{name}-cuda-bf16")
                )
            if dev == "cpu" and name == "cpu_kernel":  # its own bf16 code (float inside), not torch's
                out.append(pytest.param(name, dev, torch.bfloat16, 4, False, id=f"{name}-cpu-bf16"))
    return out


@pytest.mark.engine  # the attention kernels over whole packed steps: seconds, not the unit tier's inner loop
@pytest.mark.parametrize(("name", "dev", "dtype", "block_size", "rendered"), _configs())
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_backend_equals_the_reference(monkeypatch, name, dev, dtype, block_size, rendered, case, graph):
    cls = REGISTRY[name]
    device = torch.device(dev)
    why = None if rendered else cls.unusable(device, dtype, block_size=block_size)
    if why is not None:
        pytest.skip(f"{name} cannot run here: {why}")
    if rendered:
        _rendered(monkeypatch, name)
    window, softcap, alibi, sinks = CASES[case]
    needs = {f for f, on in (("softcap", softcap), ("alibi", alibi), ("sinks", sinks)) if on}
    if not needs <= cls.applies():
        pytest.skip(f"{name} does not apply {', '.join(sorted(needs - cls.applies()))}")
    step = _Step(DECODES if graph else REQUESTS, block_size, dtype, device)
    backend = cls(step.kv, block_size, device, HEADS, 64)
    meta = step.metadata(backend, graph)
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)]) if alibi else None
    sink = torch.linspace(-2.0, 3.0, HEADS) if sinks else None
    extra = {}
    if softcap is not None:
        extra["softcap"] = softcap
    if slopes is not None:
        extra["alibi_slopes"] = slopes.to(device, dtype)
    if sink is not None:
        extra["s_aux"] = sink.to(device, dtype)
    scale = 0.3
    out, _ = attention.paged_attention(
        types.SimpleNamespace(layer_idx=0),
        step.q.to(device, dtype)[None],
        step.key.to(device, dtype),
        step.value.to(device, dtype),
        None,
        scaling=scale,
        sliding_window=window,
        batchjob_meta=meta,
        **extra,
    )
    ref = step.reference(scale, window, softcap, slopes, sink)
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(out[0].double().cpu(), ref, rtol=tol, atol=tol)
    # The hook wrote the step's keys where the layout says: the cache now holds every request's keys.
    k_cache = step.kv[0][0].double().cpu()
    for (ctx, _, _), t, k in zip(step.requests, step.tables, step.keys, strict=True):
        got = k_cache[t].reshape(-1, KV_HEADS, DIM)[:ctx]
        torch.testing.assert_close(got, k.to(dtype).double(), rtol=0, atol=0)


def test_what_backends_declare():
    """The declarations the registry chooses by: features, devices, dtypes, block sizes, option names."""
    assert set(OPTION_CHOICES) == set(ATTENTION_BACKENDS)  # the option's values, declared without torch
    assert len({cls.option for cls in REGISTRY.values()}) == len(REGISTRY)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for name, cls in REGISTRY.items():
        assert cls.name == name and "sliding_window" in cls.computes
        assert cls.computes <= cls.applies()
        # encoders (issue 24): the torch reference, its CPU-kernel subclass and flex attend both ways
        both_ways = name in ("torch", "cpu_kernel", "flex")
        assert cls.bidirectional == both_ways and ("bidirectional" in cls.features()) == both_ways
        assert cls.default_block_size % cls.page_multiple == 0
    assert supported_features() == {
        "sliding_window",
        "softcap",
        "sinks",
        "bidirectional",
        "bidirectional_window",
        "image_both_ways",
    }
    # a window both ways (ModernBERT), image tokens both ways (Gemma 3): the torch reference and its CPU-kernel
    # subclass only
    for feature in ("bidirectional_window", "image_both_ways"):
        assert {n for n, c in REGISTRY.items() if feature in c.computes} == {"torch", "cpu_kernel"}
    assert choose_attention(cuda, torch.bfloat16, frozenset({"image_both_ways"})).backend == "torch"
    assert REGISTRY["flex"].applies() >= {"softcap", "sinks", "alibi"}
    for name in ("flash_attn", "varlen"):
        cls = REGISTRY[name]
        assert cls.unusable(cpu, torch.bfloat16) == "it needs a CUDA device"
        assert "takes float16 or bfloat16, not float32" in cls.unusable(cuda, torch.float32)
        assert "multiple of 256 tokens, not 16" in cls.unusable(cuda, torch.bfloat16, block_size=16)
        assert cls.default_block_size == 256
    assert REGISTRY["cpu_kernel"].unusable(cuda, torch.float32) == "it needs a CPU device"
    assert "does not implement softcap" in REGISTRY["torch"].unusable(
        cpu, torch.float64, frozenset({"softcap"})
    )
    assert "does not implement sinks" in REGISTRY["cpu_kernel"].unusable(
        cpu, torch.float32, frozenset({"sinks"})
    )
    with pytest.raises(ConfigError, match="attention backend must be one of auto"):
        choose_attention(cpu, torch.float32, backend="flash_attn2")
    # The option values and the backends' own names both choose.
    assert choose_attention(cpu, torch.float64, backend="torch").backend == "torch"
    assert choose_attention(cpu, torch.float64, backend="flex").block_size == 16


def test_the_hook_refuses_what_a_backend_does_not_apply():
    """A layer handing soft-capping to a backend that does not apply it fails loudly (never chosen at load)."""
    step = _Step(DECODES, 4, torch.float64, torch.device("cpu"))
    backend = REGISTRY["torch"](step.kv, 4, torch.device("cpu"), HEADS, 64)
    meta = step.metadata(backend, False)
    with pytest.raises(AssertionError, match="the torch backend does not apply softcap"):
        attention.paged_attention(
            types.SimpleNamespace(layer_idx=0), step.q[None], step.key, step.value, None,
            scaling=0.3, batchjob_meta=meta, softcap=2.0,
        )  # fmt: skip
