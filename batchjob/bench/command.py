"""The ``batchjob bench`` command: options, the order of the runs, and the report (text and JSON)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from batchjob.bench.engines import Result, agreement, run_hf_cb, run_ours, run_static, workload_num_blocks
from batchjob.bench.workload import Workload, dataset_workload, synthetic_workload
from batchjob.engine.options import by_engine_name, job_options
from batchjob.errors import ConfigError
from batchjob.program import apply, engine_flags, errors, main

BASELINES = ("ours", "hf-cb", "static", "llama.cpp")
DEFAULT_BASELINES = ("ours", "hf-cb", "static")  # llama.cpp is built separately (examples/peers/)


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


def _inference(fn: Callable[[], Result]) -> Result:
    import torch

    with torch.inference_mode():
        return fn()


def _in_worker_thread(fn: Callable[[], Result]) -> Result:
    """Run ``fn`` in a fresh thread, as transformers CB runs its own loop: like for like on a busy machine."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = _inference(fn)
        except BaseException as e:  # re-raised in the caller's thread below
            box["error"] = e

    thread = threading.Thread(target=target, name="batchjob-bench")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _fastest(tries: list[Result]) -> Result:
    """An engine's figure over repeated runs: the first failure if any run failed, else the fastest run;
    ``walls`` lists every run's wall time."""
    failed = [r for r in tries if r.error]
    best = failed[0] if failed else min(tries, key=lambda r: r.wall_s)
    best.walls = [r.wall_s for r in tries]
    return best


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the machine skews timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _num_blocks(ctx: click.Context, param: click.Parameter, value: str) -> int | str | None:
    if value in ("workload", "auto"):
        return None if value == "auto" else value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected 'workload', 'auto' or an integer, got {value!r}") from None
    if n < 1:
        raise click.BadParameter(f"must be >= 1, got {n}")
    return n


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


# -- the report ------------------------------------------------------------------------------------------


def _best(results: Sequence[Result], name: str, with_tokens: bool = False) -> Result | None:
    ok = [r for r in results if r.name == name and r.error is None and (r.outputs or not with_tokens)]
    return max(ok, key=lambda r: r.output_tps) if ok else None


def summarize(results: list[Result]) -> dict[str, Any]:
    """Ratios ours/theirs (output tokens/s), against each baseline's best setting, and the agreement counts."""
    ours = _best(results, "ours")
    summary: dict[str, Any] = {"ratios": {}, "best": {}, "agreement": {}}
    for name in BASELINES[1:]:
        best = _best(results, name)
        if best is None:
            continue
        summary["best"][name] = best.label
        if ours is not None:
            summary["ratios"][f"ours/{name}"] = ours.output_tps / best.output_tps if best.output_tps else None
            # Agreement against the fastest setting that gave its tokens back (llama-batched-bench prints
            # none, and on a loaded machine it can be the fastest).
            tokens = _best(results, name, with_tokens=True)
            if tokens is not None:
                summary["agreement"][name] = agreement(ours, tokens)
    return summary


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f} MiB"


def format_report(
    work: Workload, results: list[Result], summary: dict[str, Any], header: str, notes: Sequence[str] = ()
) -> str:
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
            runs = f"  (fastest of {', '.join(f'{w:.2f}' for w in r.walls)} s)" if len(r.walls) > 1 else ""
            lines.append(
                f"{r.label:<{width}}  {r.wall_s:>8.2f} {r.output_tps:>10.1f} {r.total_tps:>12.1f}{runs}"
            )
    lines.extend(notes)
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
            f"{x['preemptions']} preemptions; prompt-lookup drafts {x['accepted_draft_tokens']} kept of "
            f"{x['draft_tokens']}"
            + (
                f"; {x['short_spin_steps']} steps with the short OpenMP spin (other programs were busy)"
                if x.get("short_spin_steps")
                else ""
            )
        )
    memory = [
        f"{r.label}: {_mib(r.extra.get('peak_rss_mib'))} peak RSS, KV cache {_mib(r.extra.get('kv_mib'))}"
        for r in results
        if not r.error and ("kv_mib" in r.extra or "peak_rss_mib" in r.extra)
    ]
    if memory:
        lines.append("memory: " + "; ".join(memory))
    for name, agree in summary["agreement"].items():
        lines.append(
            f"agreement: ours == {name} greedy tokens on {agree['equal']}/{agree['total']} requests "
            "(token-exact; fp rounding may flip a few)"
        )
    return "\n".join(lines)


def _llama_cpp_runs(
    engine: Any, work: Workload, threads: int, notes: list[str], progress: Callable[[str], None]
) -> list[tuple[str, Callable[[], Result]]]:
    """llama.cpp's runs of this workload (llama-server; llama-batched-bench at an equal shape), or a note
    saying how to build it."""
    from batchjob.bench import llama_cpp

    bins = llama_cpp.bin_dir()
    if bins is None:
        notes.append(llama_cpp.BUILD_HINT)
        return []
    dtype = str(engine.dtype).removeprefix("torch.")
    gguf = llama_cpp.convert(Path(engine.model_id), dtype, bins, progress)
    slots = min(engine.config.max_num_seqs, len(work.prompts))  # as many at once as ours may run
    kv = engine.kv_token_bytes  # llama.cpp's cache is of the same type as ours (-ctk/-ctv at --dtype)
    runs: list[tuple[str, Callable[[], Result]]] = [
        (
            f"llama.cpp server slots={slots}",
            lambda: llama_cpp.run_server(bins, gguf, work, dtype, threads, slots, kv),
        )
    ]
    if llama_cpp.equal_shape(work) is not None:
        runs.append(
            (
                "llama.cpp batched-bench",
                lambda: llama_cpp.run_batched_bench(bins, gguf, work, dtype, threads, kv),
            )
        )
    return runs


# -- the command -----------------------------------------------------------------------------------------


@main.command("bench")
@click.option("--model", default=None, help="Local model folder or hub id (default: embedded SmolLM2-135M).")
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
    "--hf-cb-num-blocks",
    default="workload",
    show_default=True,
    callback=_num_blocks,
    help="Cache blocks (256 tokens each) for transformers' continuous batching: 'workload' (room for every "
    "request at once), 'auto' (its own sizing: most of free memory) or a number.",
)
@click.option(
    "--baselines",
    type=Baselines(),
    default=",".join(DEFAULT_BASELINES),
    show_default=True,
    help="Which engines to run, of " + ",".join(BASELINES) + ". llama.cpp (its llama-server on the workload, "
    "and llama-batched-bench too when every request has the same lengths) needs `bash "
    "examples/peers/llama_cpp.sh` once; it runs the model converted to GGUF at --dtype, KV cache the same.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here."
)
@click.option(
    "--threads",
    type=int,
    callback=_positive,
    help="torch intra-op threads for every engine (default: torch's).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run every engine this many times, in rounds (ours, static, hf-cb, ours, ...); each engine's "
    "figure is its fastest run, since a busy machine only ever adds time. Every run's wall time is reported.",
)
@click.option(
    "--worker-thread/--main-thread",
    default=False,
    show_default=True,
    help="Run ours and static generate in a worker thread, as transformers CB runs its loop (on a busy "
    "machine the main thread can be several times slower).",
)
@click.option(
    "--task",
    type=click.Choice(["generate", "embed", "classify", "score"]),
    default="generate",
    show_default=True,
    help="embed, classify, score: ours against sentence-transformers encode and HF forward in padded batches, "
    "on docstrings of installed packages (bench/tasks.py); --num-requests texts.",
)
@click.option(
    "--text-tokens", type=LengthRange(), default="20,512", show_default=True, help="--task: text lengths."
)
@click.option(
    "--st-batch-sizes",
    type=TokenBudgets(),
    default="16,32,64,128",
    show_default=True,
    help="--task embed: sentence-transformers batch sizes tried (32, its default, always).",
)
@click.option(
    "--hf-batch-size", type=int, default=32, show_default=True, help="--task: HF forward batch size."
)
# our engine's options, as `batchjob run` has them (engine/options.py); --task is the bench's own, above
@apply(engine_flags([name for name, _, _ in job_options() if name != "task"]))
@errors
def bench(
    model: str | None,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    dataset: Path | None,
    static_batch_size: int,
    hf_cb_max_batch_tokens: list[int | None],
    hf_cb_num_blocks: int | str | None,
    baselines: list[str],
    json_path: Path | None,
    threads: int | None,
    repeat: int,
    worker_thread: bool,
    task: str,
    text_tokens: tuple[int, int],
    st_batch_sizes: list[int | None],
    hf_batch_size: int,
    **engine_options: Any,
) -> None:
    """Benchmark our engine against transformers' continuous batching and static generate, in one process.

    Every engine runs the same token-id prompts with the same per-request output lengths (greedy, EOS
    ignored), after a short warm-up. Prints output and total tokens/s, ratios ours/theirs, where our time
    goes, and how many greedy outputs agree token for token.
    """
    if task != "generate":  # the prefill-only tasks have their own runs and report
        from batchjob.bench.tasks import task_bench

        sizes = [b for b in st_batch_sizes if b is not None]
        options = by_engine_name(engine_options)
        task_bench(
            task, model, num_requests, seed, text_tokens, sizes, hf_batch_size, threads, json_path, options
        )
        return
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from batchjob import Engine
    from batchjob.job.owned import check_target

    if json_path is not None:
        check_target(json_path, "--json")  # before any work: never over a job's files

    def progress(msg: str) -> None:
        click.echo(msg, err=True)

    default_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    load_before = _load_average()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        progress("loading our engine ...")
        engine = Engine.from_pretrained(model, **by_engine_name(engine_options))
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

        runs: list[tuple[str, Callable[[], Result]]] = []
        if "ours" in baselines:
            runs.append(("ours", lambda: run_ours(engine, work, vocab_size)))
        hf_model = None
        if "static" in baselines or "hf-cb" in baselines:
            # A separate, unmodified copy: the engine's model has our paged attention plugged in.
            hf_model = AutoModelForCausalLM.from_pretrained(
                engine.model_id, dtype=engine.dtype, trust_remote_code=False
            )
            hf_model.to(engine.device).eval()
        pad_id = engine.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
        if "static" in baselines:
            runs.append(("static", lambda: run_static(hf_model, work, static_batch_size, pad_id, vocab_size)))
        if "hf-cb" in baselines:  # last: it switches the model's attention implementation while it runs
            cb_blocks = workload_num_blocks(work) if hf_cb_num_blocks == "workload" else hf_cb_num_blocks
            assert cb_blocks is None or isinstance(cb_blocks, int)
            for budget in hf_cb_max_batch_tokens:
                runs.append(
                    (
                        f"hf-cb max_batch_tokens={budget or 'auto'}",
                        lambda b=budget: run_hf_cb(hf_model, work, b, vocab_size, cb_blocks),
                    )
                )
        from batchjob.engine.cpu.bf16 import slow_bf16

        notes = [line for line in [slow_bf16(engine.device, engine.dtype)] if line is not None]  # bf16 slower
        if "llama.cpp" in baselines:
            runs += _llama_cpp_runs(engine, work, used_threads, notes, progress)
        tries: list[list[Result]] = [[] for _ in runs]
        for round_ in range(repeat):
            for (label, fn), done in zip(runs, tries, strict=True):
                progress(f"running {label}{f' (run {round_ + 1} of {repeat})' if repeat > 1 else ''} ...")
                done.append(_in_worker_thread(fn) if worker_thread else _inference(fn))
        results = [_fastest(done) for done in tries]
    finally:
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(default_threads)  # a process-wide setting: leave it as found (tests share it)

    summary = summarize(results)
    header = (
        f"batchjob bench: model {Path(engine.model_id).name}, device {engine.device}, "
        f"dtype {str(engine.dtype).removeprefix('torch.')}, torch threads {used_threads}, "
        f"load average {load_before} before, {_load_average()} after (a busy machine makes timings noisy)"
    )
    click.echo(format_report(work, results, summary, header, notes))
    if json_path is not None:
        body = {
            "options": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in click.get_current_context().params.items()
            },
            "versions": {
                "batchjob": importlib.metadata.version("batchjob"),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "model": engine.model_id,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "torch_threads": used_threads,
            "worker_thread": worker_thread,
            "load_average_before_after": [load_before, _load_average()],
            "workload": work.describe() | {"seed": seed},
            "results": [r.as_dict() for r in results],
            **summary,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        click.echo(f"results written to {json_path}")
