"""Where a generation run's time goes, by kind of op: GEMMs of prompt chunks and of decode steps, the output
head, attention, elementwise ops (norms, rotary, activations, residual adds), sampling; and page faults.

    python measurements/profile_ops.py [--model DIR] [--dtype bfloat16] [--threads 2] [--num-requests 16]
                                       [--prompt-len 128] [--output-len 32]

Our engine only, greedy, drafts off, the bench's synthetic prompts (seed 0): one timed run (wall time, prompt
and decode steps, page faults and kernel time from getrusage; a decode step's split between the CPU library's
linear and decode-attention kernels, timed inside each step, and the rest: transformers' modules in Python,
their small ops, the engine's own work), then the same workload with fresh prompts (seed 1, so no prefix is
cached) under torch.profiler: the self time of each op, summed by kind, and the ten largest ops by shape;
last, the torch ops one decode step dispatches. A step of more than ``--num-requests`` rows counts as a
prompt step.
"""

from __future__ import annotations

import argparse
import collections
import resource
import time

import torch

KERNEL_SECONDS: collections.Counter[str] = collections.Counter()  # wall time in the library's kernels


def _add(engine, work) -> None:
    from batchjob import SamplingParams

    for i, (prompt, n) in enumerate(zip(work.prompts, work.max_new_tokens, strict=True)):
        params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=n)
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params)


def _run(engine, work) -> list[tuple[int, float, float, float]]:
    """Each step's rows, seconds, and seconds in the linear and in the decode-attention kernel."""
    _add(engine, work)
    steps = []
    while engine.has_unfinished():
        t, before, kernels = time.perf_counter(), engine.stats.batched_tokens, dict(KERNEL_SECONDS)
        engine.step()
        seconds = time.perf_counter() - t
        linear, attention = (KERNEL_SECONDS[k] - kernels.get(k, 0.0) for k in ("linear", "attention"))
        steps.append((engine.stats.batched_tokens - before, seconds, linear, attention))
    return steps


def _ops_in_one_decode_step(engine, work, rows: int) -> int:
    """Step until a step of at most ``rows`` rows has run (the prompts are in), count the next one's ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not str(func).startswith("profiler.")  # not the kernels' labels (_label_kernels)
            return func(*args, **(kwargs or {}))

    _add(engine, work)
    while True:
        before = engine.stats.batched_tokens
        engine.step()
        if engine.stats.batched_tokens - before <= rows:
            break
    with Count() as count:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return count.ops


def _label_kernels(vocab: int) -> None:
    """The CPU library's kernels (decode attention, the bf16 linears) are no torch ops: label their calls, or
    their time would be missing from the table. A linear's label says the output head or a step's rows."""
    from batchjob.engine.cpu import kernel

    decode, linear = kernel.paged_decode, kernel.linear_bf16

    def labelled_decode(*a, **k):
        t = time.perf_counter()
        with torch.profiler.record_function("batchjob::paged_decode"):
            out = decode(*a, **k)
        KERNEL_SECONDS["attention"] += time.perf_counter() - t
        return out

    def labelled_linear(x, packed, bias, n):
        rows = x.numel() // x.shape[-1]
        what = "head" if n == vocab else ("prompt" if rows > 16 else "decode")
        t = time.perf_counter()
        with torch.profiler.record_function(f"batchjob::linear_bf16 {what}"):
            out = linear(x, packed, bias, n)
        KERNEL_SECONDS["linear"] += time.perf_counter() - t
        return out

    kernel.paged_decode, kernel.linear_bf16 = labelled_decode, labelled_linear


def _kind(name: str, shapes: str, vocab: int) -> str:
    if name.startswith("batchjob::linear_bf16"):
        what = name.rsplit(" ", 1)[1]
        return "output head" if what == "head" else f"GEMM, {what} steps"
    if name == "mkldnn::_linear_pointwise" or name in ("aten::mm", "aten::addmm", "aten::linear"):
        if str(vocab) in shapes:
            return "output head"
        rows = int(shapes.split(",")[1]) if shapes.startswith("[[1, ") else 0
        return "GEMM, prompt steps" if rows > 16 else "GEMM, decode steps"
    if "attention" in name or name in (
        "aten::index_copy_",
        "aten::_index_put_impl_",
        "batchjob::paged_decode",
    ):
        return "attention (incl. KV writes)"
    if name in ("aten::argmax", "aten::max", "aten::topk", "aten::sort", "aten::softmax"):
        return "sampling"
    if name in (
        "aten::mul",
        "aten::silu",
        "aten::add",
        "aten::pow",
        "aten::mean",
        "aten::rsqrt",
        "aten::neg",
    ):
        return "elementwise (norms, rotary, SiLU*up, residuals)"
    if name in ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::index_select", "aten::clone"):
        return "copies, casts, gathers"
    return "the rest (views, allocations, small ops)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile

    from batchjob import Engine, SamplingParams
    from batchjob.bench.workload import synthetic_workload

    engine = Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, num_speculative_tokens=0)
    _label_kernels(engine.vocab_size)
    lens = (args.prompt_len, args.prompt_len), (args.output_len, args.output_len)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    steps = _run(engine, synthetic_workload(engine.vocab_size, args.num_requests, *lens, seed=0))
    wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    decode = [s for s in steps if s[0] <= args.num_requests]
    print(
        f"wall {wall:.2f} s: {len(steps) - len(decode)} prompt steps "
        f"{sum(s[1] for s in steps) - sum(s[1] for s in decode):.2f} s, {len(decode)} decode steps "
        f"{sum(s[1] for s in decode):.2f} s; {r1.ru_minflt - r0.ru_minflt} page faults, "
        f"kernel {r1.ru_stime - r0.ru_stime:.2f} s, user {r1.ru_utime - r0.ru_utime:.2f} s"
    )
    if decode:
        step, linear, attention = (1000 * sum(s[i] for s in decode) / len(decode) for i in (1, 2, 3))
        print(
            f"a decode step {step:.1f} ms: the linear kernel {linear:.1f}, the decode-attention kernel "
            f"{attention:.1f}, the rest {step - linear - attention:.1f} (the linear kernel: bf16 on "
            "AVX512-BF16 without AMX; elsewhere the linears are in the rest)"
        )
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _run(engine, synthetic_workload(engine.vocab_size, args.num_requests, *lens, seed=1))
    profiled_wall = time.perf_counter() - t
    events = prof.key_averages(group_by_input_shape=True)
    kinds: collections.Counter[str] = collections.Counter()
    for e in events:
        kinds[_kind(e.key, str(e.input_shapes), engine.vocab_size)] += e.self_cpu_time_total / 1e6
    total = sum(kinds.values())
    print(
        f"profiled run {profiled_wall:.2f} s, {total:.2f} s of it in ops (the rest: Python between them), by kind:"
    )
    for kind, seconds in kinds.most_common():
        print(f"  {kind:50s} {seconds:7.2f} s {100 * seconds / total:5.1f}%")
    print("largest ops:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"  {e.key:40s} {e.self_cpu_time_total / 1e6:6.2f} s {e.count:6d} calls  {e.input_shapes}")
    work = synthetic_workload(engine.vocab_size, args.num_requests, lens[0], (4, 4), seed=2)
    print(
        f"torch ops dispatched in one decode step: {_ops_in_one_decode_step(engine, work, args.num_requests)}"
    )


if __name__ == "__main__":
    main()
