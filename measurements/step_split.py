"""Where a decode step's time goes: the CPU library's linear and decode-attention kernels, timed inside each
step, and everything else (transformers' modules in Python and their small ops, the engine's own work); and
how many torch ops one decode step dispatches.

Our engine only, greedy, drafts off, the bench's synthetic prompts; two rounds of the same workload, each
printing its decode steps' mean time and the split. A step of at most ``--num-requests`` rows counts as a
decode step. The linear kernel runs in bf16 on a CPU with AVX512-BF16 and no AMX; elsewhere (float32, oneDNN's
linears) "linears" reads 0 and their time is in "the rest".
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def _timed(module, name: str, acc: dict[str, float]) -> None:
    """Wrap ``module.name`` so that its calls add their wall time to ``acc[name]``."""
    plain = getattr(module, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t

    setattr(module, name, timed)


def _add(engine, work, tag: str) -> None:
    from batchjob import SamplingParams

    for i, (prompt, n) in enumerate(zip(work.prompts, work.max_new_tokens, strict=True)):
        params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=n)
        engine.add_request(f"{tag}-{i}", prompt, params)


def _ops_in_one_decode_step(engine, rows: int) -> int:
    """Step until a step of at most ``rows`` rows has run (the prompts are in), count the next one's ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    while True:
        before = engine.stats.batched_tokens
        engine.step()
        if engine.stats.batched_tokens - before <= rows:
            break

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    mode = Count()
    with mode:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return sum(mode.counts.values())


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

    from batchjob import Engine, SamplingParams
    from batchjob.bench.workload import synthetic_workload
    from batchjob.engine.cpu import kernel

    acc: dict[str, float] = collections.defaultdict(float)
    _timed(kernel, "linear_bf16", acc)
    _timed(kernel, "paged_decode", acc)
    engine = Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, num_speculative_tokens=0)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up
    lens = (args.prompt_len, args.prompt_len), (args.output_len, args.output_len)
    for rnd in range(2):
        _add(engine, synthetic_workload(engine.vocab_size, args.num_requests, *lens, seed=rnd), str(rnd))
        steps = []  # (seconds, linear kernel seconds, attention kernel seconds) of each decode step
        while engine.has_unfinished():
            rows, before = engine.stats.batched_tokens, dict(acc)
            t = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t
            if engine.stats.batched_tokens - rows <= args.num_requests:
                linear = acc["linear_bf16"] - before.get("linear_bf16", 0.0)
                attention = acc["paged_decode"] - before.get("paged_decode", 0.0)
                steps.append((seconds, linear, attention))
        total, linear, attention = (1000 * sum(s[i] for s in steps) / len(steps) for i in range(3))
        print(
            f"round {rnd + 1}: {len(steps)} decode steps, {total:.1f} ms a step: linears {linear:.1f}, "
            f"decode attention {attention:.1f}, the rest {total - linear - attention:.1f}"
        )
    _add(engine, synthetic_workload(engine.vocab_size, args.num_requests, lens[0], (4, 4), seed=2), "ops")
    print(f"torch ops dispatched in one decode step: {_ops_in_one_decode_step(engine, args.num_requests)}")


if __name__ == "__main__":
    main()
