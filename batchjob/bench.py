"""``batchjob bench``: one workload through our engine and the alternatives a user already has, side by side.

The alternatives are transformers' own continuous batching (a ``ContinuousBatchingManager``, one per token
budget tried) and plain ``model.generate`` on left-padded static batches. Every engine gets the very same
token-id prompts and the same per-request ``max_new_tokens``, greedy, EOS ignored, so each does the same work;
each is warmed up first and timed alone, in this one process. The report gives output and total tokens/s,
the ratios ours/theirs, where our wall time goes (model forward vs everything else), and how many of our
greedy outputs equal the baselines' token for token (a sanity column: fp32 rounding may flip a few).

This module knows workloads and timing; it drives the engine through its public API only.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from batchjob.cli import _errors, main
from batchjob.errors import ConfigError, InputError
from batchjob.job.spec import DTYPE_CHOICES

BASELINES = ("ours", "hf-cb", "static")
_WARMUP_PROMPT_LEN = 16
_WARMUP_OUTPUT_LEN = 4


# -- the workload ----------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests every engine runs: token-id prompts and how many tokens each must generate."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    source: str  # "synthetic" or the dataset path

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "source": self.source,
            "num_requests": len(self.prompts),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_min_max": [min(lens), max(lens)],
            "output_len_min_max": [min(self.max_new_tokens), max(self.max_new_tokens)],
        }


def log_uniform_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths in [lo, hi], uniform in log space: most prompts short, a long tail."""
    a, b = math.log(lo), math.log(hi + 1)
    return [min(hi, max(lo, int(math.exp(rng.uniform(a, b))))) for _ in range(n)]


def output_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic_workload(
    vocab_size: int, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> Workload:
    """Random token-id prompts from a fixed seed: the same ids for every engine and every run."""
    rng = random.Random(seed)
    lengths = log_uniform_lengths(rng, num_requests, *prompt_len)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, output_lengths(rng, num_requests, *output_len), "synthetic")


def read_texts(path: Path, limit: int) -> list[str]:
    """The first ``limit`` non-empty ``prompt`` (else ``text``) values of a JSONL or Parquet file."""
    if not path.is_file():
        raise InputError(f"--dataset {path}: no such file")
    suffix = "".join(path.suffixes[-2:]) if path.suffix in (".gz", ".zst") else path.suffix
    rows: list[dict[str, Any]] = []
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        cols = [c for c in ("prompt", "text") if c in names]
        rows = pq.read_table(path, columns=cols[:1]).slice(0, limit * 2).to_pylist() if cols else []
        if not cols:
            raise InputError(f"--dataset {path}: no 'prompt' or 'text' column (columns: {', '.join(names)})")
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a bad line is skipped: a benchmark needs prompts, not every row
                    if isinstance(row, dict):
                        rows.append(row)
                if len(rows) >= limit * 2:
                    break
    else:
        raise InputError(f"--dataset {path}: expected a .jsonl or .parquet file")
    texts = []
    for row in rows:
        value = row.get("prompt", row.get("text"))
        if isinstance(value, str) and value.strip():
            texts.append(value)
    if not texts:
        raise InputError(f"--dataset {path}: no row with a non-empty 'prompt' or 'text' string")
    return texts[:limit]


def dataset_workload(
    path: Path, tokenizer: Any, num_requests: int, output_len: tuple[int, int], seed: int, max_prompt: int
) -> Workload:
    texts = read_texts(path, num_requests)
    prompts = [tokenizer(t).input_ids[:max_prompt] or [0] for t in texts]
    rng = random.Random(seed)
    return Workload(prompts, output_lengths(rng, len(prompts), *output_len), str(path))


# -- timing each engine ----------------------------------------------------------------------------------


@dataclass
class Result:
    name: str  # "ours", "hf-cb", "static"
    settings: dict[str, Any]
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # the tokens asked for: the same work for every engine
    outputs: list[list[int]] = field(repr=False)  # generated ids per request, in workload order
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def label(self) -> str:
        return self.name + "".join(f" {k}={v}" for k, v in self.settings.items())

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d["output_tokens_per_s"] = self.output_tps
        d["total_tokens_per_s"] = self.total_tps
        return d


def _warmup_workload(vocab_size: int) -> Workload:
    rng = random.Random(12345)
    prompts = [[rng.randrange(vocab_size) for _ in range(_WARMUP_PROMPT_LEN + i)] for i in range(2)]
    return Workload(prompts, [_WARMUP_OUTPUT_LEN] * 2, "warmup")


def run_ours(engine: Any, work: Workload, vocab_size: int) -> Result:
    from batchjob.sampling import SamplingParams

    def params(w: Workload) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in w.max_new_tokens]

    warm = _warmup_workload(vocab_size)
    engine.generate(warm.prompts, params(warm))
    before = engine.stats.as_dict()
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params(work))
    wall = time.perf_counter() - start
    after = engine.stats.as_dict()
    diff = {k: after[k] - before[k] for k in ("forward_seconds", "step_seconds", "steps", "batched_tokens")}
    diff["preemptions"] = after["preemptions"] - before["preemptions"]
    diff["overhead_seconds"] = wall - diff["forward_seconds"]
    diff["overhead_fraction"] = diff["overhead_seconds"] / wall if wall > 0 else 0.0
    settings = {
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
    }
    failed = [o for o in outs if o.finish_reason == "error"]
    error = f"{len(failed)} request(s) failed, e.g. {failed[0].error}" if failed else None
    outputs = [o.token_ids for o in outs]
    return Result("ours", settings, wall, work.prompt_tokens, work.output_tokens, outputs, diff, error)


def run_static(model: Any, work: Workload, batch_size: int, pad_id: int, vocab_size: int) -> Result:
    """Plain ``generate`` on left-padded batches in workload order; each batch runs to its longest output."""
    import torch
    from transformers import GenerationConfig

    device = model.device

    def run(w: Workload) -> tuple[list[list[int]], int]:
        outputs: list[list[int]] = []
        generated = 0
        for lo in range(0, len(w.prompts), batch_size):
            prompts, wants = w.prompts[lo : lo + batch_size], w.max_new_tokens[lo : lo + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            # eos_token_id=[] (not None, which would fall back to the model's EOS): never stop early.
            config = GenerationConfig(
                do_sample=False, max_new_tokens=max(wants), eos_token_id=[], pad_token_id=pad_id
            )
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            new = out[:, width:].tolist()
            generated += len(prompts) * max(wants)
            outputs.extend(row[:n] for row, n in zip(new, wants, strict=True))
        return outputs, generated

    warm = _warmup_workload(vocab_size)
    run(warm)
    start = time.perf_counter()
    outputs, generated = run(work)
    wall = time.perf_counter() - start
    return Result(
        "static",
        {"batch_size": batch_size},
        wall,
        work.prompt_tokens,
        work.output_tokens,
        outputs,
        {"generated_tokens_including_padding_waste": generated},
    )


def run_hf_cb(model: Any, work: Workload, max_batch_tokens: int | None, vocab_size: int) -> Result:
    """transformers' continuous batching: a manager with per-request ``max_new_tokens`` and EOS disabled."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_new_tokens), eos_token_id=-1)
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    # The hints generate_batch() would give: they size the block table and the requests per batch.
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.max_new_tokens),
        num_requests=len(work.prompts),
    )
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    settings = {"max_batch_tokens": "auto" if max_batch_tokens is None else max_batch_tokens}

    def run(w: Workload, tag: str) -> tuple[dict[str, list[int]], str | None]:
        ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
        for rid, prompt, n in zip(ids, w.prompts, w.max_new_tokens, strict=True):
            # eos_token_id=-1 matches no token: EOS is ignored; max_new_tokens is this request's own.
            manager.add_request(prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    return done, "transformers' generation thread stopped"
                continue
            if res.is_finished():
                if res.error is not None:
                    return done, f"request {res.request_id}: {res.error}"
                done[res.request_id] = list(res.generated_tokens)
        return done, None

    manager.start()
    try:
        run(_warmup_workload(vocab_size), "warmup")
        start = time.perf_counter()
        done, error = run(work, "bench")
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [done.get(f"bench-{i}", []) for i in range(len(work.prompts))]
    return Result("hf-cb", settings, wall, work.prompt_tokens, work.output_tokens, outputs, error=error)


def agreement(ours: Result, other: Result) -> dict[str, int]:
    equal = sum(a == b for a, b in zip(ours.outputs, other.outputs, strict=True))
    return {"equal": equal, "total": len(ours.outputs)}


# -- options ---------------------------------------------------------------------------------------------


class LengthRange(click.ParamType):
    """``MIN,MAX`` (or ``N`` for a fixed length), integers with 1 <= MIN <= MAX."""

    name = "MIN,MAX"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            self.fail(f"expected MIN,MAX integers, got {value!r}", param, ctx)
        if len(nums) == 1:
            nums = nums * 2
        if len(nums) != 2 or not 1 <= nums[0] <= nums[1]:
            self.fail(f"expected MIN,MAX with 1 <= MIN <= MAX, got {value!r}", param, ctx)
        return nums[0], nums[1]


class TokenBudgets(click.ParamType):
    """A comma list of token budgets for transformers' continuous batching; ``auto`` is its own default."""

    name = "N[,N...]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[int | None]:
        if isinstance(value, list):
            return value
        out: list[int | None] = []
        for part in str(value).split(","):
            part = part.strip()
            if part == "auto":
                out.append(None)
                continue
            try:
                n = int(part)
            except ValueError:
                self.fail(f"expected integers or 'auto', got {part!r}", param, ctx)
            if n < 1:
                self.fail(f"token budgets must be >= 1, got {n}", param, ctx)
            out.append(n)
        return list(dict.fromkeys(out))


class Baselines(click.ParamType):
    name = "LIST"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        names = [p.strip() for p in str(value).split(",") if p.strip()]
        bad = [n for n in names if n not in BASELINES]
        if bad or not names:
            self.fail(f"choose from {','.join(BASELINES)}; got {value!r}", param, ctx)
        return [n for n in BASELINES if n in names]


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


# -- the report ------------------------------------------------------------------------------------------


def _best(results: Sequence[Result], name: str) -> Result | None:
    ok = [r for r in results if r.name == name and r.error is None]
    return max(ok, key=lambda r: r.output_tps) if ok else None


def summarize(results: list[Result]) -> dict[str, Any]:
    """Ratios ours/theirs (output tokens/s), against each baseline's best setting, and the agreement counts."""
    ours = _best(results, "ours")
    summary: dict[str, Any] = {"ratios": {}, "best": {}, "agreement": {}}
    for name in ("hf-cb", "static"):
        best = _best(results, name)
        if best is None:
            continue
        summary["best"][name] = best.label
        if ours is not None:
            summary["ratios"][f"ours/{name}"] = ours.output_tps / best.output_tps if best.output_tps else None
            summary["agreement"][name] = agreement(ours, best)
    return summary


def format_report(work: Workload, results: list[Result], summary: dict[str, Any], header: str) -> str:
    width = max([len("engine"), *(len(r.label) for r in results)])
    lines = [
        header,
        f"workload: {len(work.prompts)} requests ({work.source}), {work.prompt_tokens} prompt tokens, "
        f"{work.output_tokens} output tokens; greedy, EOS ignored",
        "",
        f"{'engine':<{width}}  {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12}",
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.label:<{width}}  failed: {r.error}")
        else:
            lines.append(f"{r.label:<{width}}  {r.wall_s:>8.2f} {r.output_tps:>10.1f} {r.total_tps:>12.1f}")
    lines.append("")
    for key, ratio in summary["ratios"].items():
        other = summary["best"][key.split("/")[1]]
        lines.append(f"ratio {key} (output tok/s, vs {other}): {ratio:.2f}x")
    ours = _best(results, "ours")
    if ours is not None:
        x = ours.extra
        other_in_step = x["step_seconds"] - x["forward_seconds"]
        outside = ours.wall_s - x["step_seconds"]
        lines.append(
            f"our time: {ours.wall_s:.2f} s wall = forward {x['forward_seconds']:.2f} s "
            f"({100 * x['forward_seconds'] / ours.wall_s:.1f}%) + other {x['overhead_seconds']:.2f} s "
            f"({100 * x['overhead_fraction']:.1f}%: {other_in_step:.2f} s in step() outside the forward, "
            f"{outside:.2f} s outside step()); {x['steps']} steps, {x['batched_tokens']} batched tokens, "
            f"{x['preemptions']} preemptions"
        )
    for name, agree in summary["agreement"].items():
        lines.append(
            f"agreement: ours == {name} greedy tokens on {agree['equal']}/{agree['total']} requests "
            "(token-exact; fp rounding may flip a few)"
        )
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------------------


@main.command("bench")
@click.option("--model", default=None, help="Local model folder or hub id (default: embedded SmolLM2-135M).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default="auto",
    show_default=True,
    help="Weights dtype (auto: float32 on CPU, bfloat16 on CUDA).",
)
@click.option("--num-requests", type=int, default=64, show_default=True, callback=_positive)
@click.option(
    "--prompt-len",
    type=LengthRange(),
    default="24,600",
    show_default=True,
    help="Synthetic prompt lengths in tokens, log-uniform (mostly short).",
)
@click.option(
    "--output-len",
    type=LengthRange(),
    default="8,100",
    show_default=True,
    help="Tokens to generate, uniform.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload.")
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL or Parquet file with a 'prompt' or 'text' column: its first --num-requests rows are the prompts.",
)
@click.option(
    "--static-batch-size",
    type=int,
    default=8,
    show_default=True,
    callback=_positive,
    help="Batch size of static generate.",
)
@click.option(
    "--hf-cb-max-batch-tokens",
    type=TokenBudgets(),
    default="256",
    show_default=True,
    help="Token budget(s) for transformers' continuous batching, e.g. 128,256,512 or auto; the best is compared.",
)
@click.option(
    "--baselines",
    type=Baselines(),
    default=",".join(BASELINES),
    show_default=True,
    help="Which engines to run.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here."
)
@click.option("--max-num-batched-tokens", type=int, callback=_positive, help="Our engine's tokens per step.")
@click.option("--max-num-seqs", type=int, callback=_positive, help="Our engine's running requests at once.")
@_errors
def bench(
    model: str | None,
    device: str,
    dtype: str,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    dataset: Path | None,
    static_batch_size: int,
    hf_cb_max_batch_tokens: list[int | None],
    baselines: list[str],
    json_path: Path | None,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
) -> None:
    """Benchmark our engine against transformers' continuous batching and static generate, in one process.

    Every engine runs the same token-id prompts with the same per-request output lengths (greedy, EOS
    ignored), after a short warm-up. Prints output and total tokens/s, ratios ours/theirs, where our time
    goes, and how many greedy outputs agree token for token.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from batchjob import Engine

    def progress(msg: str) -> None:
        click.echo(msg, err=True)

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        progress("loading our engine ...")
        engine = Engine.from_pretrained(
            model,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        vocab_size = int(engine.vocab_size)
        longest = engine.max_model_len
        if dataset is not None:
            work = dataset_workload(
                dataset, engine.tokenizer, num_requests, output_len, seed, longest - output_len[1]
            )
        else:
            if prompt_len[1] + output_len[1] > longest:
                raise ConfigError(
                    f"--prompt-len max {prompt_len[1]} + --output-len max {output_len[1]} exceeds the model's "
                    f"context of {longest} tokens"
                )
            work = synthetic_workload(vocab_size, num_requests, prompt_len, output_len, seed)

        results: list[Result] = []
        runs: list[tuple[str, Callable[[], Result]]] = []
        if "ours" in baselines:
            runs.append(("ours", lambda: run_ours(engine, work, vocab_size)))
        hf_model = None
        if "static" in baselines or "hf-cb" in baselines:
            # A separate, unmodified copy: the engine's model has our paged attention plugged in.
            hf_model = AutoModelForCausalLM.from_pretrained(engine.model_id, dtype=engine.dtype)
            hf_model.to(engine.device).eval()
        pad_id = engine.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
        if "static" in baselines:
            runs.append(("static", lambda: run_static(hf_model, work, static_batch_size, pad_id, vocab_size)))
        if "hf-cb" in baselines:  # last: it switches the model's attention implementation while it runs
            for budget in hf_cb_max_batch_tokens:
                runs.append(
                    (
                        f"hf-cb max_batch_tokens={budget or 'auto'}",
                        lambda b=budget: run_hf_cb(hf_model, work, b, vocab_size),
                    )
                )
        for label, fn in runs:
            progress(f"running {label} ...")
            with torch.inference_mode():
                results.append(fn())
    finally:
        transformers.logging.set_verbosity(verbosity)

    summary = summarize(results)
    header = (
        f"batchjob bench: model {Path(engine.model_id).name}, device {engine.device}, "
        f"dtype {str(engine.dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}"
    )
    click.echo(format_report(work, results, summary, header))
    if json_path is not None:
        body = {
            "command": " ".join(["batchjob", *sys.argv[1:]]) if sys.argv else "batchjob bench",
            "model": engine.model_id,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "workload": work.describe() | {"seed": seed},
            "results": [r.as_dict() for r in results],
            **summary,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        click.echo(f"results written to {json_path}")
