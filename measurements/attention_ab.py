"""A/B in one process: the CPU default attention (the compiled C++ decode kernel for one-token rows, SDPA per
prompt chunk) against the FlexAttention backend (compiled by inductor's CPU template), on the default model
in float32. One engine; the two backends are swapped step by step, so both see the same batches and the
same machine load.

    python measurements/attention_ab.py            (about three minutes; the first flex step compiles)

Prints decode-step times at several batch sizes, prompt-chunk step times, and a whole mixed workload
(the bench's synthetic one) run to completion by each backend in alternate rounds; ratios are flex / default
(above 1: flex is slower).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from batchjob import Engine, SamplingParams
from batchjob.bench.workload import synthetic_workload
from batchjob.engine.attention import flex_kernel as flex


def main() -> None:
    engine = Engine.from_pretrained(None, device="cpu", dtype="float32", num_speculative_tokens=0)
    runner = engine.runner
    assert runner.attention.name == "cpu_kernel", f"the CPU default here is {runner.attention.name}"
    backends = {"default": runner.attention, "flex": runner.new_backend("flex")}

    def use(name: str) -> None:
        runner.attention = backends[name]

    def timed_step(name: str) -> float:
        use(name)
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    rng = random.Random(0)
    t0 = time.perf_counter()
    use("flex")
    engine.generate([[5] * 40, [6] * 3], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    print(f"flex warm-up (compiles a decode and a chunk kernel): {time.perf_counter() - t0:.1f} s")

    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=60)
    for rows in (4, 16, 64):
        for i in range(rows):
            engine.add_request(f"{rows}-{i}", [rng.randrange(100, 40000) for _ in range(300)], params)
        while engine.scheduler.waiting or any(r.num_computed_tokens < 300 for r in engine.scheduler.running):
            engine.step()
        times: dict[str, list[float]] = {"default": [], "flex": []}
        for _ in range(10):
            for name, acc in times.items():
                acc.append(timed_step(name))
        d, f = statistics.median(times["default"]), statistics.median(times["flex"])
        print(
            f"decode step, {rows} rows of ~300 tokens: default {d * 1e3:.1f} ms, flex {f * 1e3:.1f} ms, ratio {f / d:.2f}"
        )
        while engine.has_unfinished():
            engine.step()

    one = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=1)
    for length in (128, 512):
        times = {"default": [], "flex": []}
        for k in range(4):
            for name, acc in times.items():
                engine.add_request(
                    f"p{length}-{k}-{name}", [rng.randrange(100, 40000) for _ in range(length)], one
                )
                acc.append(timed_step(name))
                while engine.has_unfinished():
                    engine.step()
        d, f = min(times["default"]), min(times["flex"])
        print(f"prompt chunk of {length}: default {d * 1e3:.0f} ms, flex {f * 1e3:.0f} ms, ratio {f / d:.2f}")

    work = synthetic_workload(engine.vocab_size, 32, (16, 512), (16, 128), seed=0)
    sp = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in work.max_new_tokens]
    walls: dict[str, list[float]] = {"default": [], "flex": []}
    outputs = {}
    for _ in range(2):
        for name, acc in walls.items():
            use(name)
            engine.reset_prefix_cache()
            t = time.perf_counter()
            outs = engine.generate(work.prompts, sp)
            acc.append(time.perf_counter() - t)
            outputs[name] = [o.token_ids for o in outs]
    d, f = min(walls["default"]), min(walls["flex"])
    same = sum(a == b for a, b in zip(outputs["default"], outputs["flex"], strict=True))
    print(
        f"workload of 32 requests (prompts 16-512, outputs 16-128, {work.output_tokens} output tokens): "
        f"default {work.output_tokens / d:.0f} tok/s, flex {work.output_tokens / f:.0f} tok/s, "
        f"ratio {f / d:.2f}; greedy outputs equal {same}/32"
    )
    compiled = torch._dynamo.eval_frame._debug_get_cache_entry_list(flex._paged_kernel.__code__)
    print(f"flex kernels compiled in this run: {len(compiled)} (every step shape above reused them)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    main()
