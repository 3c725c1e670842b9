"""The ``batchjob bench`` command: the order of the runs, and the report (text and JSON); its options are
in ``options.py``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

import batchjob
from batchjob.bench import roofline
from batchjob.bench.engines import (
    Result,
    agreement,
    load_average,
    run_hf_cb,
    run_ours,
    run_static,
    workload_num_blocks,
)
from batchjob.bench.engines import header as bench_header
from batchjob.bench.options import BASELINES, BENCH_FLAGS, BenchOptions
from batchjob.bench.workload import Workload, dataset_workload, synthetic_workload
from batchjob.engine.options import by_engine_name, job_options
from batchjob.errors import ConfigError
from batchjob.program import apply, engine_flags, errors, main

# -- running ---------------------------------------------------------------------------------------------


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

    from batchjob.engine.cpu.spin import release_team

    thread = threading.Thread(target=target, name="batchjob-bench")
    release_team()  # this thread waits: its idle OpenMP team would make the worker's threads spin briefly
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
        + (f" (of a {_mib(r.extra['kv_budget_mib'])} budget)" if r.extra.get("kv_budget_mib") else "")
        for r in results
        if not r.error and ("kv_mib" in r.extra or "peak_rss_mib" in r.extra)
    ]
    if memory:
        lines.append("memory: " + "; ".join(memory))
    if summary.get("roofline") is not None:
        lines.append(roofline.format_line(summary["roofline"]))
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
@apply(BENCH_FLAGS)
# our engine's options, as `batchjob run` has them (engine/options.py); --task is the bench's own, above
@apply(engine_flags([name for name, _, _ in job_options() if name != "task"]))
@errors
def bench(**params: Any) -> None:
    """Benchmark our engine against transformers' continuous batching and static generate, in one process.

    Every engine runs the same token-id prompts with the same per-request output lengths (greedy, EOS
    ignored), after a short warm-up. Prints output and total tokens/s, ratios ours/theirs, where our time
    goes, and how many greedy outputs agree token for token.
    """
    from batchjob.job.owned import check_target

    opts = BenchOptions.from_params(params)
    if opts.adapters and opts.task != "generate":
        raise click.UsageError(f"--adapters runs generation; it does not go with --task {opts.task}")
    if opts.json_path is not None:  # before any work, for every workload: never over a job's files
        check_target(opts.json_path, "--json")
    if opts.task != "generate":  # the prefill-only tasks have their own runs and report
        from batchjob.bench.tasks import task_bench

        sizes = [b for b in opts.st_batch_sizes if b is not None]
        task_bench(
            opts.task,
            opts.model,
            opts.num_requests,
            opts.seed,
            opts.text_tokens,
            sizes,
            opts.hf_batch_size,
            opts.threads,
            opts.json_path,
            by_engine_name(opts.engine_options),
            opts.repeat,
        )
        return
    if opts.image_sizes is not None:  # image rows: their own runs and report (bench/images.py)
        from batchjob.bench.images import image_bench

        image_bench(opts, _run_rounds, by_engine_name(opts.engine_options))
        return
    _bench_generate(opts)


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


def _bench_generate(opts: BenchOptions) -> None:
    """Load, run every engine in rounds, report; torch's threads and transformers' logging left as found."""
    import torch
    import transformers

    default_threads = torch.get_num_threads()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    used_threads = torch.get_num_threads()
    load_before = load_average()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        engine, work = _load(opts)
        if opts.adapters:
            from batchjob.bench.lora import lora_bench  # peft and the adapters' runs: only for this workload

            lora_bench(opts, engine, work, used_threads)
            return
        notes: list[str] = []
        runs = _runs(opts, engine, work, used_threads, notes)
        left_out = roofline.uncounted(engine.model) if opts.roofline else None
        if left_out is not None:
            notes.append(f"roofline left out: {left_out}")
        counts = opts.roofline and "ours" in opts.baselines and left_out is None
        limits = _limits(engine, work) if counts else None
        results = _run_rounds(runs, opts.repeat, opts.worker_thread)
        figures = _roofline(engine, work, results, limits)
    finally:
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(default_threads)  # a process-wide setting: leave it as found (tests share it)

    summary = summarize(results) | {"roofline": figures}
    header = bench_header("batchjob bench", engine, used_threads, load_before)
    click.echo(format_report(work, results, summary, header, notes))
    if opts.json_path is not None:
        context = {"torch_threads": used_threads, "load_average_before_after": [load_before, load_average()]}
        _write_json(opts, opts.json_path, engine, work, results, summary, context)


def _load(opts: BenchOptions) -> tuple[Any, Workload]:
    """Our engine, and the workload every engine runs (from --dataset, or synthetic within its context)."""
    from batchjob import Engine

    _progress("loading our engine ...")
    engine = Engine.from_pretrained(opts.model, **by_engine_name(opts.engine_options))
    longest = engine.max_model_len
    prompt_len, output_len = opts.prompt_len, opts.output_len
    if opts.dataset is not None:
        if output_len[1] >= longest:  # no room for a prompt (a slice by a negative length would cut the end)
            raise ConfigError(
                f"--output-len max {output_len[1]} leaves no room for a --dataset prompt in the model's context "
                f"of {longest} tokens: give a smaller --output-len"
            )
        work = dataset_workload(
            opts.dataset, engine.tokenizer, opts.num_requests, output_len, opts.seed, longest - output_len[1]
        )
        if work.note:  # what the figures leave out of the file, or cut
            _progress(f"batchjob bench: {work.note}")
    else:
        if prompt_len[1] + output_len[1] > longest:
            raise ConfigError(
                f"--prompt-len max {prompt_len[1]} + --output-len max {output_len[1]} exceeds the model's "
                f"context of {longest} tokens"
            )
        vocab_size = int(engine.vocab_size)
        work = synthetic_workload(vocab_size, opts.num_requests, prompt_len, output_len, opts.seed)
    return engine, work


def _runs(
    opts: BenchOptions, engine: Any, work: Workload, threads: int, notes: list[str]
) -> list[tuple[str, Callable[[], Result]]]:
    """Every run of one round, labelled, in order: ours, static, hf-cb (each token budget), llama.cpp; the
    notes for the report are added to ``notes``."""
    from transformers import AutoModelForCausalLM

    vocab_size = int(engine.vocab_size)
    baselines = opts.baselines
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
        batch = opts.static_batch_size
        runs.append(("static", lambda: run_static(hf_model, work, batch, pad_id, vocab_size)))
    if "hf-cb" in baselines:  # last: it switches the model's attention implementation while it runs
        cb_blocks = opts.hf_cb_num_blocks
        if cb_blocks == "workload":
            cb_blocks = workload_num_blocks(work)
        assert cb_blocks is None or isinstance(cb_blocks, int)
        for budget in opts.hf_cb_max_batch_tokens:
            runs.append(
                (
                    f"hf-cb max_batch_tokens={budget or 'auto'}",
                    lambda b=budget: run_hf_cb(hf_model, work, b, vocab_size, cb_blocks),
                )
            )
    from batchjob.engine.cpu.bf16 import slow_bf16

    notes += [line for line in [slow_bf16(engine.device, engine.dtype)] if line is not None]  # bf16 slower
    if "llama.cpp" in baselines:
        runs += _llama_cpp_runs(engine, work, threads, notes, _progress)
    return runs


def _limits(engine: Any, work: Workload) -> roofline.Limits:
    """This machine's GEMM peak and weight bandwidth at the model's shapes, before the runs."""
    _progress("measuring this machine's limits at the model's shapes (roofline) ...")
    tokens = min(engine.config.max_num_batched_tokens, work.prompt_tokens)  # a full prefill step
    platform = getattr(engine, "platform", None)
    before = platform.before_step if platform is not None else (lambda: None)
    limits = roofline.measure_limits(engine.model, engine.device, engine.dtype, tokens, before)
    if platform is not None:
        platform.idle()  # as the engine leaves it when it has no request
    return limits


def _roofline(
    engine: Any, work: Workload, results: list[Result], limits: roofline.Limits | None
) -> dict[str, Any] | None:
    """Our best run's shares of the limits (None without a run of ours that succeeded); the prefill-only
    pass that splits its time runs here, after every engine's runs, and the limits are measured once more."""
    ours = _best(results, "ours")
    if limits is None or ours is None:
        return None
    _progress("running a prefill-only pass of ours (the roofline's time split) ...")
    prefill = roofline.prefill_pass(engine, work.prompts)
    limits = roofline.faster(limits, _limits(engine, work))  # measured again: the run lies between the two
    shape = roofline.model_shape(engine.model)
    prompt_lens = [len(p) for p in work.prompts]
    return roofline.shares(shape, limits, prompt_lens, ours.extra, prefill, work.max_new_tokens)


def _run_rounds(
    runs: list[tuple[str, Callable[[], Result]]], repeat: int, worker_thread: bool
) -> list[Result]:
    """Every run ``repeat`` times, in rounds (a slow spell of the machine hits every engine alike); each
    engine's figure is its fastest run."""
    tries: list[list[Result]] = [[] for _ in runs]
    for round_ in range(repeat):
        for (label, fn), done in zip(runs, tries, strict=True):
            _progress(f"running {label}{f' (run {round_ + 1} of {repeat})' if repeat > 1 else ''} ...")
            done.append(_in_worker_thread(fn) if worker_thread else _inference(fn))
    return [_fastest(done) for done in tries]


def _write_json(
    opts: BenchOptions,
    path: Path,
    engine: Any,
    work: Workload,
    results: list[Result],
    summary: dict[str, Any],
    context: dict[str, Any],
) -> None:
    """The report as JSON: the options as given, versions, the machine's state (``context``), every result."""
    import torch
    import transformers

    body = {
        "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in click.get_current_context().params.items()
        },
        "versions": {
            "batchjob": batchjob.__version__,  # also when it runs from a checkout, not installed
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": engine.model_id,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch_threads": context["torch_threads"],
        "worker_thread": opts.worker_thread,
        "load_average_before_after": context["load_average_before_after"],
        "workload": work.describe() | {"seed": opts.seed},
        "results": [r.as_dict() for r in results],
        **summary,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    click.echo(f"results written to {path}")
