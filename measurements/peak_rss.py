"""Our engine's peak RSS at load and after a run, beside its KV budget: what the process holds against
what the job needs (one engine, this process).

    python measurements/peak_rss.py DTYPE [MODEL_DIR|-]     (default model: SmolLM2-135M; 16 x 128 + 32)
"""

from __future__ import annotations

import sys
import time

import torch


def _status() -> str:
    with open("/proc/self/status", encoding="ascii") as f:
        return " ".join(line.split(":")[0] + " " + line.split()[1] for line in f if line.startswith(("VmHWM", "VmRSS")))


def main() -> None:
    torch.set_num_threads(2)
    from batchjob import Engine
    from batchjob.bench import engines
    from batchjob.bench.workload import synthetic_workload

    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python measurements/peak_rss.py DTYPE [MODEL_DIR|-]\n\n" + (__doc__ or "").strip())
        sys.exit(0 if len(sys.argv) > 1 else 2)
    dtype = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    with torch.inference_mode():
        engine = Engine.from_pretrained(model, device="cpu", dtype=dtype, num_speculative_tokens=0)
        print(f"loaded: {_status()} kB")
        work = synthetic_workload(engine.vocab_size, 16, (128, 128), (32, 32), seed=0)
        start = time.perf_counter()
        r = engines.run_ours(engine, work, engine.vocab_size)
        wall = time.perf_counter() - start
        print(f"ran {wall:.1f} s, {r.output_tps:.1f} out tok/s, KV {r.extra.get('kv_mib')} MiB of a {r.extra.get('kv_budget_mib')} MiB budget: {_status()} kB")


if __name__ == "__main__":
    main()
