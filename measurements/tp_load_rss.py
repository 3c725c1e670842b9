"""Peak host memory (RSS) of one tensor-parallel rank while it loads its shard, by slice (today) or by full
load + slice (before shard loading), each in a fresh process. On the CPU, one rank at a time: the group is a
stand-in for the rank's number and device (loading does no collective).

    python measurements/gpu/random_model.py /tmp/qwen2.5-0.5b qwen2.5-0.5b
    python measurements/tp_load_rss.py /tmp/qwen2.5-0.5b 2 [DTYPE]      # DTYPE: the engine's (default bfloat16)

Weights kept in the checkpoint's dtype on the CPU stay views of the memory-mapped file (``from_pretrained``'s
and ``safe_open``'s alike): those pages show as mapped-file RSS, shared page cache rather than the process's own.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``; ``RssAnon``: its own allocations, ``RssFile``: mapped files)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def one(folder: str, n: int, rank: int, how: str, dtype: str) -> None:
    from types import SimpleNamespace

    import torch

    from batchjob.engine.config import EngineConfig
    from batchjob.engine.parallel import load_model
    from batchjob.engine.parallel.shard import shard_model
    from batchjob.models import load_model_and_tokenizer

    config = EngineConfig(device="cpu", dtype=dtype)
    start = rss_mib()
    if how == "slice":
        group = SimpleNamespace(rank=rank, size=n, device=torch.device("cpu"), all_reduce=lambda t: None)
        model, _, _ = load_model(folder, config, False, group)
    else:
        model, _, _ = load_model_and_tokenizer(folder, config.dtype, config.device)
        shard_model(model, rank, n, lambda t: None)
    with torch.no_grad():  # every weight paged in, as the first forward would
        held = sum(float(p.sum()) * 0 + p.numel() * p.element_size() for p in model.parameters()) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    after = f"{rss_mib('RssAnon'):.0f} / {rss_mib('RssFile'):.0f}"
    print(f"| {how} | {rank} | {start:.0f} | {peak:.0f} | {peak - start:.0f} | {after} | {held:.0f} |")


def main(folder: str, n: str = "2", dtype: str = "bfloat16") -> None:
    print(
        "| load | rank | RSS before (MiB) | peak RSS | peak - before | after: own / mapped files | weights held |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for how in ("full", "slice"):
        for rank in range(int(n)):
            cmd = [sys.executable, __file__, "--one", folder, n, str(rank), how, dtype]
            subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":  # a child process: one rank's load
        one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("folder", help="a model folder (measurements/gpu/random_model.py writes one)")
        ap.add_argument("n", nargs="?", default="2", help="the number of ranks (2)")
        ap.add_argument("dtype", nargs="?", default="bfloat16", help="the engine's dtype (bfloat16)")
        args = ap.parse_args()
        main(args.folder, args.n, args.dtype)
