"""A/B in one process: step times of the default model (CPU, float32) with its linear weights in oneDNN's
blocked layout (what the engine uses) against a plain oneDNN copy, the two swapped step by step.

    python measurements/pack_layout_ab.py
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

from batchjob import Engine, SamplingParams
from batchjob.engine.cpu.linear import OneDnn


def timed_step(engine: Engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def main() -> None:
    engine = Engine.from_pretrained(None, device="cpu", num_speculative_tokens=0)
    layers = [m for m in engine.model.modules() if isinstance(vars(m).get("_batchjob_packed"), OneDnn)]

    def plain(packed: OneDnn) -> OneDnn:  # the same layer's product on a plain (row-major) oneDNN copy
        other = copy.copy(packed)
        other.weight = packed.weight.to_dense().to_mkldnn()
        return other

    layouts = {
        "blocked": [m._batchjob_packed for m in layers],
        "plain": [plain(m._batchjob_packed) for m in layers],
    }

    def use(name: str) -> None:
        for m, w in zip(layers, layouts[name], strict=True):
            m._batchjob_packed = w

    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=60)
    for rows in (4, 16, 43, 64):
        for i in range(rows):
            engine.add_request(f"{rows}-{i}", [rng.randrange(100, 40000) for _ in range(300)], params)
        while engine.scheduler.waiting or any(r.num_computed_tokens < 300 for r in engine.scheduler.running):
            engine.step()
        times: dict[str, list[float]] = {"blocked": [], "plain": []}
        for _ in range(10):
            for name, acc in times.items():
                use(name)
                acc.append(timed_step(engine))
        use("blocked")
        b, p = statistics.median(times["blocked"]), statistics.median(times["plain"])
        print(
            f"decode step, {rows} rows: blocked {b * 1e3:.0f} ms, plain {p * 1e3:.0f} ms, ratio {p / b:.2f}"
        )
        while engine.has_unfinished():
            engine.step()

    one = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=1)
    for length in (256, 512):
        times = {"blocked": [], "plain": []}
        for k in range(3):
            for name, acc in times.items():
                use(name)
                engine.add_request(
                    f"p{length}-{k}-{name}", [rng.randrange(100, 40000) for _ in range(length)], one
                )
                acc.append(timed_step(engine))
                while engine.has_unfinished():
                    engine.step()
        use("blocked")
        b, p = min(times["blocked"]), min(times["plain"])
        print(f"prompt of {length}: blocked {b * 1e3:.0f} ms, plain {p * 1e3:.0f} ms, ratio {p / b:.2f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    main()
