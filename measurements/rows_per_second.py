"""Rows per second of a whole ``batchjob run`` on many short rows: the job layer's own cost.

A tiny random model (from ``tests/tiny_models.py``) with ``--max-new-tokens 1`` makes the engine cheap, so the
figure is mostly reading, prompt building, bookkeeping and writing. Each configuration runs as a real
``python -m batchjob run`` process; ``--code DIR`` runs another checkout of batchjob (e.g. a git worktree of an
older commit) side by side, in alternating rounds, so the two are compared on the same busy machine:

    git worktree add /tmp/base <commit>
    python measurements/rows_per_second.py --rows 200000 --code . --code /tmp/base --rounds 2

``--task embed|classify|score`` runs that task instead of generation (``--pooling mean`` for embed); each
line also gives the process's peak resident memory, so runs of 100,000 and 1,000,000 rows show whether
memory stays flat as the job grows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument(
        "--code", action="append", help="a batchjob checkout to run (repeatable; default: this one)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--ids", choices=["both", "derived", "column"], default="both", help="which id modes to run"
    )
    ap.add_argument("--work", help="folder for the data, model and outputs (default: a temporary one)")
    ap.add_argument("--task", choices=["generate", "embed", "score"], default="generate")
    args = ap.parse_args()
    codes = [str(Path(c).resolve()) for c in (args.code or [str(ROOT)])]
    work = Path(args.work or tempfile.mkdtemp(prefix="batchjob-rows-"))
    from tests.tiny_models import make_model

    model = work / "model"
    if not (model / "config.json").exists():
        make_model(model, "llama")
    data = work / "rows.jsonl"
    if not data.exists():
        with open(data, "w") as f:
            for i in range(args.rows):
                f.write(json.dumps({"rid": f"row-{i}", "text": f"review {i}: fine"}) + "\n")
    configs = {"derived ids": [], "--id-column rid": ["--id-column", "rid"]}
    if args.ids != "both":
        configs = {k: v for k, v in configs.items() if (args.ids == "column") == bool(v)}
    task = ["--max-new-tokens", "1"] if args.task == "generate" else ["--task", args.task]
    task += ["--pooling", "mean"] if args.task == "embed" else []
    print(f"{args.rows} rows, {' '.join(task)}, tiny llama; {work}")
    for r in range(args.rounds):
        for name, extra in configs.items():
            for code in codes:
                out = work / f"out-{r}-{abs(hash((name, code)))}"
                cmd = [sys.executable, "-m", "batchjob", "run", "--input", str(data), "--output", str(out)]
                cmd += ["--model", str(model), *task, "--no-chat", *extra]
                env = dict(os.environ, PYTHONPATH=code, HF_HUB_OFFLINE="1")
                start = time.monotonic()
                proc = subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work
                )
                output = proc.stdout.read().decode(errors="replace")
                # wait4: this process's own peak resident memory (not the largest of all children so far)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                wall = time.monotonic() - start
                if proc.returncode:
                    sys.exit(f"failed ({proc.returncode}): {output[-4000:]}")
                print(
                    f"round {r}  {name:16s} {code:30s} {wall:7.1f} s  {args.rows / wall:8.0f} rows/s  "
                    f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB"
                )


if __name__ == "__main__":
    main()
