"""The bench's roofline: how close our engine's prefill and decode came to this machine's own limits.

Two limits, measured here in a second or two with the model's own layers (so the engine's own kernels: the
packed oneDNN linears on the CPU, cuBLAS on CUDA), in the run's dtype on the run's device: the GEMM rate at
a prefill step's shape (the model's largest linear over a full step's tokens), and the weight bandwidth of
a decode step (every linear of the model over a few rows). Against them, from what the bench observes:
prefill FLOPs / (peak x prefill time) and decode bytes (the weights each step, the KV cache each row reads)
/ (bandwidth x decode time); end to end, the least time both limits allow the run (prefill FLOPs at the
peak, decode at the binding limit) / its forward time.

The engine has no prefill or decode phase (a step mixes both), so the split of the time is the bench's:
prefill time is the forward time of a prefill-only pass over the same prompts (each request samples one
token, from its prompt's logits); decode time is the run's forward time less that. This module knows
shapes, timings and arithmetic; it drives the engine only through ``generate`` and its stats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
_MEASURE_SECONDS = 0.4  # per limit: long enough to average over a busy machine's noise, short for the bench
DECODE_ROWS = 8  # rows per decode-shaped call: few enough that reading the weights is the cost


@dataclass(frozen=True)
class Shape:
    """What one token costs in the model's linears, and what one step reads."""

    body_params: int  # weights of the linear layers a token passes through (the output head excluded)
    head_params: int  # the output head's weights: run once per sampled row
    weight_bytes: int  # every linear's weights (head included): what a decode step reads
    layers: int  # for the attention FLOPs (0 where the config does not say)
    query_dim: int  # attention heads x head size
    kv_bytes_per_token: int = 0  # a token's keys and values over every layer: what a decode row reads of each


@dataclass(frozen=True)
class Limits:
    """This machine's measured limits at the model's shapes."""

    peak_flops: float  # FLOP/s of the largest linear over ``gemm_tokens`` rows
    bandwidth: float  # bytes/s of every linear's weights read over DECODE_ROWS rows
    gemm_tokens: int
    gemm_shape: tuple[int, int]  # (in, out) features of the linear timed
    features: str  # "cpu: avx2, avx512f" or the CUDA device's name


def faster(a: Limits, b: Limits) -> Limits:
    """The higher of two measurements of each limit (a busy machine only ever takes some away)."""
    return replace(a, peak_flops=max(a.peak_flops, b.peak_flops), bandwidth=max(a.bandwidth, b.bandwidth))


def _linears(model: Any) -> tuple[list[Any], Any]:
    """The model's ``nn.Linear`` layers but its output head, and the head (None where it is no Linear)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return body, head if isinstance(head, torch.nn.Linear) else None


def uncounted(model: Any) -> str | None:
    """Why the roofline can't count this model's work (None: it can): weights outside ``nn.Linear`` (GPT-2's
    ``Conv1D``, fused MoE experts), which its FLOP and byte counts would leave out."""
    import torch

    counted = {
        id(p)
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
        for p in m.parameters()
    }
    other = {type(m).__name__: 0 for m in model.modules()}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if p.dim() >= 2 and id(p) not in counted:
                other[type(m).__name__] += p.numel()
    left = sum(other.values())
    body = sum(m.weight.numel() for m in _linears(model)[0])
    if left <= 0.02 * max(body, 1):
        return None
    kinds = ", ".join(name for name, n in other.items() if n)
    return f"{left:,} of the model's weights are in modules other than nn.Linear ({kinds}), which it does not count"


def model_shape(model: Any) -> Shape:
    import torch

    body, head = _linears(model)
    layers = [*body, *([head] if head is not None else [])]
    config = getattr(model, "config", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (
        int(getattr(config, "hidden_size", 0) or 0) // heads if heads else 0
    )
    depth = int(getattr(config, "num_hidden_layers", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    itemsize = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()  # the cache's
    return Shape(
        body_params=sum(m.weight.numel() for m in body),
        head_params=head.weight.numel() if head is not None else 0,
        # element_size, not storage: a packed layer's weight keeps its shape and dtype without its memory
        weight_bytes=sum(m.weight.numel() * m.weight.element_size() for m in layers),
        layers=depth,
        query_dim=heads * int(head_dim or 0),
        kv_bytes_per_token=2 * depth * kv_heads * int(head_dim or 0) * itemsize,
    )


def cpu_features(flags_line: str) -> list[str]:
    """The CPU flags that decide our kernels' speed, in a fixed order, from a /proc/cpuinfo ``flags`` line."""
    flags = set(flags_line.split())
    return [f for f in RELEVANT_CPU_FLAGS if f in flags]


def device_features(device: Any) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "cpu: flags unknown"
    line = next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")), "")
    return f"cpu: {', '.join(cpu_features(line)) or 'none of ' + ', '.join(RELEVANT_CPU_FLAGS)}"


def _seconds_per_call(fn: Callable[[], object], device: Any, before: Callable[[], object]) -> float:
    """The fastest of repeated calls' mean times (after one untimed call), over about _MEASURE_SECONDS;
    ``before`` runs ahead of each timed batch, as the engine's platform hook runs ahead of each step."""
    import torch

    def sync() -> None:  # CUDA runs asynchronously: a timing ends when the device is done
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best, spent, calls = float("inf"), 0.0, 1
    while spent < _MEASURE_SECONDS:
        before()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        took = time.perf_counter() - start
        best, spent = min(best, took / calls), spent + took
        calls = min(calls * 2, 64)
    return best


def measure_limits(
    model: Any, device: Any, dtype: Any, gemm_tokens: int, before: Callable[[], object] = lambda: None
) -> Limits:
    """Time the model's largest linear a prompt token passes through (not the output head, which runs on
    sampled rows only) over ``gemm_tokens`` rows (peak), then every linear over a few rows (bandwidth); the
    inputs are random, in ``dtype`` on ``device``. ``before``: the engine's platform hook (on a busy CPU it
    shortens OpenMP's spin, as it does for the engine's steps)."""
    import torch

    body, head = _linears(model)
    layers = [*body, *([head] if head is not None else [])]
    assert layers, "a model without linear layers has no roofline"
    big = max(body or layers, key=lambda m: m.weight.numel())
    gen = torch.Generator().manual_seed(0)

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    with torch.inference_mode():
        x = rand(gemm_tokens, big.in_features)
        gemm = _seconds_per_call(lambda: big(x), device, before)
        inputs = {n: rand(DECODE_ROWS, n) for n in {m.in_features for m in layers}}
        features = device_features(device)

        def every_linear() -> object:
            return [m(inputs[m.in_features]) for m in layers]

        sweep_fn: Callable[[], object] = every_linear
        if torch.device(device).type == "cuda":
            sweep_fn, how = _replayed(every_linear, torch.device(device))
            features += f", weight sweep {how}"
        sweep = _seconds_per_call(sweep_fn, device, before)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    return Limits(
        peak_flops=2 * gemm_tokens * big.in_features * big.out_features / gemm,
        bandwidth=weight_bytes / sweep,
        gemm_tokens=gemm_tokens,
        gemm_shape=(big.in_features, big.out_features),
        features=features,
    )


def _replayed(fn: Callable[[], object], device: Any) -> tuple[Callable[[], object], str]:
    """``fn`` captured in a CUDA graph, to replay: one launch for the sweep's linears, as the engine's decode
    steps run (``engine/graphs.py``). Eager, a few rows a linear time the launches, not the weight reads: the
    first H200 run's eager sweep said 260 GB/s where the card copies ~4.3 TB/s. A capture that fails leaves
    the sweep eager, and the roofline line says which it was."""
    import torch

    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()  # lazy initialisation and the library's workspaces, outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        return fn, f"eager (no CUDA graph: {str(e).splitlines()[0][:80]}; launch-bound)"
    return graph.replay, "from a CUDA graph"


def prefill_pass(engine: Any, prompts: list[list[int]]) -> dict[str, float]:
    """A prefill-only pass over ``prompts`` (one token sampled per request, from its prompt's logits), with
    the prefix cache emptied before and after: its forward seconds and steps, by the engine's stats."""
    import torch

    from batchjob.sampling import SamplingParams

    engine.reset_prefix_cache()
    before = engine.stats.as_dict()
    with torch.inference_mode():
        engine.generate(
            prompts, [SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)] * len(prompts)
        )
    after = engine.stats.as_dict()
    engine.reset_prefix_cache()
    return {k: after[k] - before[k] for k in ("forward_seconds", "steps", "batched_tokens")}


def prefill_flops(shape: Shape, prompt_lens: list[int], computed: float = 1.0) -> float:
    """Linears: 2 FLOPs per weight per prompt token, the head once per request; causal attention: QK^T and
    PV, 2 x L^2/2 x query_dim each per layer for a prompt of L tokens. ``computed``: the share of the prompt
    tokens the pass computed (the rest came from the prefix cache), scaling both (for attention a floor: a
    cached prefix's suffix attends to it all)."""
    tokens = sum(prompt_lens)
    attention = 2 * shape.layers * shape.query_dim * sum(n * n for n in prompt_lens)
    head = 2.0 * shape.head_params * len(prompt_lens)  # the head once per request: cached prefixes or not
    return computed * (2.0 * shape.body_params * tokens + attention) + head


def decode_kv_tokens(prompt_lens: list[int], output_lens: list[int]) -> int:
    """Keys (and values) the decode rows read: a request's output token t >= 2 attends to its prompt and the
    t - 1 tokens before it (the first comes from its prompt's step). Drafts verified read more: a floor."""
    return sum((n - 1) * p + (n - 1) * n // 2 for p, n in zip(prompt_lens, output_lens, strict=True) if n > 1)


def shares(
    shape: Shape,
    limits: Limits,
    prompt_lens: list[int],
    run: dict[str, Any],
    prefill: dict[str, float],
    output_lens: list[int] | None = None,
) -> dict[str, Any]:
    """The roofline figures: ``run`` is our run's stats (forward_seconds, steps, batched_tokens), ``prefill``
    the prefill-only pass's. A share is None where its time is not positive (decode time is a difference:
    noise can sink it). Decode steps of many rows (drafts verified included) can be bound by compute rather
    than by reading the weights: ``decode_flops_share`` says how close they came to the GEMM peak. With
    ``output_lens`` (each request's tokens, all generated: EOS ignored) the decode bytes count the KV cache
    each row reads beside the weights, which long prompts make the larger part (1,000-token prompts at
    SmolLM2-135M in bf16: 368 MB of keys and values a 16-row step against 270 MB of weights)."""
    computed = min(1.0, prefill["batched_tokens"] / max(sum(prompt_lens), 1))  # (shared prefixes: cached)
    flops = prefill_flops(shape, prompt_lens, computed)
    prefill_s = prefill["forward_seconds"]
    decode_s = run["forward_seconds"] - prefill_s
    decode_steps = max(int(run["steps"] - prefill["steps"]), 0)
    decode_tokens = max(int(run["batched_tokens"] - prefill["batched_tokens"]), 0)
    weight_bytes = float(shape.weight_bytes) * decode_steps
    kv_bytes = float(
        shape.kv_bytes_per_token * decode_kv_tokens(prompt_lens, output_lens or [0] * len(prompt_lens))
    )
    decode_bytes = weight_bytes + kv_bytes
    decode_flops = 2.0 * (shape.body_params + shape.head_params) * decode_tokens
    timed = decode_s > 0 and decode_steps > 0
    # The least time the limits allow the whole run: prefill at the GEMM peak, then decode at whichever of
    # the two limits binds its totals (a step-by-step bound could only be larger: this share never flatters).
    bound_s = flops / limits.peak_flops + max(
        decode_bytes / limits.bandwidth, decode_flops / limits.peak_flops
    )
    forward_s = run["forward_seconds"]
    return {
        "peak_flops_per_s": limits.peak_flops,
        "weight_bandwidth_bytes_per_s": limits.bandwidth,
        "gemm_tokens": limits.gemm_tokens,
        "gemm_shape": list(limits.gemm_shape),
        "decode_rows": DECODE_ROWS,
        "features": limits.features,
        "shape": asdict(shape),
        "prefill_flops": flops,
        "prefill_seconds": prefill_s,
        "prefill_share": flops / (limits.peak_flops * prefill_s) if prefill_s > 0 else None,
        "decode_steps": decode_steps,
        "decode_weight_bytes": weight_bytes,
        "decode_kv_bytes": kv_bytes,
        "decode_seconds": decode_s,
        "decode_share": decode_bytes / (limits.bandwidth * decode_s) if timed else None,
        "decode_tokens": decode_tokens,  # rows run by decode steps: one per request, plus drafts verified
        "decode_flops": decode_flops,
        "decode_flops_share": decode_flops / (limits.peak_flops * decode_s) if timed else None,
        "bound_seconds": bound_s,
        "end_to_end_share": bound_s / forward_s if forward_s > 0 else None,
        "split": "prefill: forward time of a prefill-only pass over the same prompts; decode: the run's "
        "forward time less that",
    }


def _rate(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def format_line(figures: dict[str, Any]) -> str:
    """One line of the bench's table: each phase's share of its limit, and what the machine ran with."""

    def pct(share: float | None) -> str:
        return "?" if share is None else f"{100 * share:.0f}%"

    steps = figures["decode_steps"]
    rows = f"{figures['decode_tokens'] / steps:.0f}" if steps else "?"
    kv_bytes = figures.get("decode_kv_bytes") or 0.0
    read = figures["decode_weight_bytes"] + kv_bytes
    kv = f" (KV {100 * kv_bytes / read:.0f}% of the bytes)" if kv_bytes else ""

    return (
        f"roofline: prefill {pct(figures['prefill_share'])} of {_rate(figures['peak_flops_per_s'], 'FLOP/s')}, "
        f"decode {pct(figures['decode_share'])} of {_rate(figures['weight_bandwidth_bytes_per_s'], 'B/s')}"
        f"{kv} "
        f"and {pct(figures['decode_flops_share'])} of peak FLOP/s at {rows} rows a step; end to end "
        f"{pct(figures['end_to_end_share'])} (the limits allow {figures['bound_seconds']:.1f} s of "
        f"{figures['prefill_seconds'] + figures['decode_seconds']:.1f} s) ({figures['features']})"
    )
