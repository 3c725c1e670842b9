"""``batchjob bench-scheduling``: what prefix caching and the admission order buy, on our engine alone.

Two synthetic workloads, each run under several engine settings in one process:

- shared prefix: every request is one long instruction plus a short, distinct suffix (a labeling job);
  with and without prefix caching.
- skewed outputs: many short answers and a few long ones, more requests than seats; admitted ``fcfs``
  (input order), ``longest-first``, ``shortest-first``, and ``static`` (the static-batching baseline).

For each run: wall time, output and total tokens/s, and per-request latency and time to first token (median
and p99, from submission). All requests are submitted at once; greedy, EOS ignored.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchjob.engine.options import by_engine_name, job_options
from batchjob.job import admission
from batchjob.program import apply, engine_flags, errors, main

ENGINE_FLAGS = [name for name, _, _ in job_options()]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _run(engine: Any, prompts: list[list[int]], outputs: list[int], order: list[int]) -> dict[str, Any]:
    from batchjob import SamplingParams

    before = engine.stats.as_dict()
    start = time.monotonic()
    for i in order:
        engine.add_request(
            f"r{i}", prompts[i], SamplingParams(max_new_tokens=outputs[i], temperature=0, ignore_eos=True)
        )
    done = []
    while engine.has_unfinished():
        done.extend(engine.step())
    wall = time.monotonic() - start
    after = engine.stats.as_dict()
    latency = [o.finish_time - start for o in done]
    ttft = [o.first_token_time - start for o in done if o.first_token_time is not None]
    gen = sum(len(o.token_ids) for o in done)
    prompt = sum(len(p) for p in prompts)
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(gen / wall, 1),
        "total_tok_s": round((gen + prompt) / wall, 1),
        "latency_median_s": round(statistics.median(latency), 2),
        "latency_p99_s": round(_pct(latency, 0.99), 2),
        "ttft_median_s": round(statistics.median(ttft), 2),
        "ttft_p99_s": round(_pct(ttft, 0.99), 2),
        "computed_prompt_tokens": after["computed_prompt_tokens"] - before["computed_prompt_tokens"],
        "cached_prompt_tokens": after["cached_prompt_tokens"] - before["cached_prompt_tokens"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "steps": after["steps"] - before["steps"],
        "_tokens": {o.request_id: o.token_ids for o in done},
    }


@main.command("bench-scheduling")
@click.option("--model", default=None, help="Local model folder or hub id (default: embedded SmolLM2-135M).")
@click.option(
    "--prefix-len", type=click.IntRange(1), default=1000, show_default=True, help="Shared instruction tokens."
)
@click.option("--prefix-requests", type=click.IntRange(1), default=32, show_default=True)
@click.option("--skew-requests", type=click.IntRange(1), default=96, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here."
)
# Our engine's options (engine/options.py); 16 seats by default, fewer than requests. Prefix caching and
# static batching are what the runs compare: each run sets them itself.
@apply(engine_flags([n for n in ENGINE_FLAGS if n != "prefix_caching"], defaults={"max_num_seqs": 16}))
@errors
def bench_scheduling(
    model: str | None,
    prefix_len: int,
    prefix_requests: int,
    skew_requests: int,
    seed: int,
    json_path: Path | None,
    **engine_options: Any,
) -> None:
    """Prefix caching on/off on a shared-prefix workload; fcfs vs longest-first vs static on skewed outputs."""
    from batchjob import Engine
    from batchjob.job.owned import check_target

    if json_path is not None:
        check_target(json_path, "--json")  # before any work: never over a job's files

    rng = random.Random(seed)  # one stream, drawn in order: the shared-prefix workload, then the skewed one

    def engine(**kw: Any) -> Any:
        return Engine.from_pretrained(model, **by_engine_name(engine_options), **kw)

    first = engine()
    vocab = first.vocab_size
    del first
    results = _shared_prefix(engine, rng, vocab, prefix_len, prefix_requests)
    skewed = _skewed(engine, rng, vocab, skew_requests)
    results.update(skewed)

    base = results["shared-prefix caching=on"]["_tokens"]
    same_prefix = base == results["shared-prefix caching=off"]["_tokens"]
    skew = [r["_tokens"] for r in skewed.values()]
    same_skew = all(t == skew[0] for t in skew)
    click.echo("run | " + " | ".join(_COLUMNS))
    for name, r in results.items():
        click.echo(f"{name} | " + " | ".join(str(r[c]) for c in _COLUMNS))
    click.echo(f"identical outputs: prefix caching on/off {same_prefix}; all admission policies {same_skew}")
    if json_path is not None:
        clean = {k: {c: v for c, v in r.items() if c != "_tokens"} for k, r in results.items()}
        json_path.write_text(json.dumps({"results": clean, "identical": [same_prefix, same_skew]}, indent=2))


_COLUMNS = [  # of the printed table
    "wall_s",
    "output_tok_s",
    "total_tok_s",
    "latency_median_s",
    "latency_p99_s",
    "ttft_median_s",
    "computed_prompt_tokens",
    "cached_prompt_tokens",
    "steps",
]


def _shared_prefix(
    engine: Callable[..., Any], rng: random.Random, vocab: int, prefix_len: int, requests: int
) -> dict[str, dict[str, Any]]:
    """One long instruction and a short suffix a request, 4 tokens out each: prefix caching on, then off."""
    instruction = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    prompts = [
        instruction + [rng.randrange(100, vocab) for _ in range(rng.randint(10, 40))] for _ in range(requests)
    ]
    outputs = [4] * requests
    results = {}
    for caching in (True, False):
        name = f"shared-prefix caching={'on' if caching else 'off'}"
        click.echo(f"running {name} ...", err=True)
        results[name] = _run(
            engine(enable_prefix_caching=caching), prompts, outputs, list(range(len(prompts)))
        )
    return results


def _skewed(
    engine: Callable[..., Any], rng: random.Random, vocab: int, requests: int
) -> dict[str, dict[str, Any]]:
    """Short prompts, mostly short answers and a tenth long ones: each admission policy (and static)."""
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 64))] for _ in range(requests)]
    outputs = [rng.randint(150, 200) if rng.random() < 0.1 else rng.randint(4, 16) for _ in range(requests)]
    size = [len(p) + o for p, o in zip(prompts, outputs, strict=True)]
    orders = {policy: admission.order(policy, size) for policy in admission.ADMISSION_CHOICES}
    results = {}
    for policy, order in orders.items():
        name = f"skewed admission={policy}"
        click.echo(f"running {name} ...", err=True)
        results[name] = _run(engine(static_batching=policy == "static"), prompts, outputs, order)
    return results
