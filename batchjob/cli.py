"""The command line: ``batchjob run``, ``validate``, ``status``, ``export`` and ``report``.

Each command parses its options, builds a JobSpec (job file first, command-line options on top), calls the
library, and maps our errors to exit codes in one place (``_errors``): no traceback for anything a user
controls. The flags of ``run`` and ``validate`` are made from the job's option declarations (``JobSpec``'s
fields, ``job/spec.py``), none by hand. The ``main`` group, that mapping and the engine's flags live in
``program.py``, which ``bench/`` uses too; importing this module registers every command.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import Field
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from batchjob.job.options import JobOption, shown_help
from batchjob.job.spec import declared
from batchjob.program import apply, engine_flags, main
from batchjob.program import errors as _errors

EXIT_CODES = """\b
Exit codes:
  0   the job is complete (or was already)
  1   the job stopped: --max-errors reached, unreadable state, a full disk, another run holds DIR
      (state is saved)
  2   a usage error: bad option, template or job file, missing input or column, model not found, a model
      that ships its own code without --trust-remote-code, a KV pool that can't hold one request of the
      full context, inputs that changed since the job started (--append takes in rows appended and new
      files), or a resume whose model, prompts or sampling differ from the saved job
  75  interrupted by SIGTERM/SIGINT: finished rows committed, in-flight requests saved (during start-up:
      nothing to save yet); run the same command again to resume (EX_TEMPFAIL: "requeue me")
  With --devices or --ray: the worst of the workers' codes (2, then 1, then 75, then 0)."""


def _job_flag(f: Field[Any], opt: JobOption) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The flag of the job option declared by ``f`` (``job/spec.py``): its name with - for _, its help with
    its default. Left out, its value is None (the job file's, else the declared default decides); the checks
    run in ``JobSpec``, with the messages the library gives."""
    flag = "--" + f.name.replace("_", "-")
    kw: dict[str, Any] = {"help": shown_help(f), "default": None, "metavar": opt.metavar}
    if str(f.type).startswith("bool"):
        return click.option(f"{flag}/--no-{flag[2:]}", f.name, **kw)
    kind = opt.cli_type or {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
    kw["type"] = click.Choice(opt.choices) if opt.choices else kind
    if opt.flag_value is not None:  # may be given alone
        kw |= {"is_flag": False, "flag_value": opt.flag_value}
    return click.option(flag, f.name, multiple=opt.multiple, **kw)


def _job_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The job file argument and a flag per option of a job, in ``JobSpec``'s order (``job/spec.py`` declares
    the job's own, ``engine/options.py`` the engine's)."""
    options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
        click.argument("job_file", required=False, type=click.Path(dir_okay=False))
    ]
    for name, f, opt in declared():
        if isinstance(opt, JobOption):
            options.append(_job_flag(f, opt))
        else:
            options += engine_flags([name])
    return apply(options)(fn)


def _shard_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--num-shards",
            type=click.IntRange(min=1),
            envvar="BATCHJOB_NUM_SHARDS",
            metavar="N",
            help="Split the job over N workers sharing --output (env BATCHJOB_NUM_SHARDS). Default: taken "
            "from Slurm, torchrun or a Kubernetes indexed job, else 1.",
        ),
        click.option(
            "--shard-index",
            type=click.IntRange(min=0),
            envvar="BATCHJOB_SHARD_INDEX",
            metavar="I",
            help="This worker's shard, 0..N-1 (env BATCHJOB_SHARD_INDEX). These two options win over "
            "torchrun's RANK/WORLD_SIZE, then SLURM_PROCID/SLURM_NTASKS (inside srun), then "
            "JOB_COMPLETION_INDEX; a Slurm array (SLURM_ARRAY_TASK_ID/_COUNT/_MIN) multiplies with those "
            "three, and inside an array task these options must name one of that task's shards.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _launch_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--devices",
            metavar="LIST",
            help="Start one worker process per device, e.g. cuda:0,cuda:1,cuda:2,cuda:3, all on this job "
            "(exit code: the worst of theirs).",
        ),
        click.option(
            "--ray",
            "ray_address",
            is_flag=False,
            flag_value="",
            default=None,
            metavar="[ADDRESS]",
            help="Run the workers as Ray tasks, one per GPU (else per CPU slot) of the cluster at ADDRESS "
            "(default: RAY_ADDRESS, else a local instance). Needs batchjob[ray] and a shared --output.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


_NOT_FORWARDED = {"num_shards", "shard_index", "devices", "ray_address", "device"}


def _worker_args(ctx: click.Context) -> list[str]:
    """The command line of ``run`` as given, without the options a launcher sets per worker."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        value = ctx.params.get(name)
        source = ctx.get_parameter_source(name)
        if name in _NOT_FORWARDED or source in (None, ParameterSource.DEFAULT) or value in (None, ()):
            continue
        if isinstance(param, click.Argument):
            args.append(str(value))
        elif isinstance(param, click.Option) and param.is_flag and param.secondary_opts:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif isinstance(param, click.Option) and param.is_flag:
            if value:
                args.append(param.opts[0])
        else:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                args += [param.opts[0], str(v)]
    return args


def _spec(ctx: click.Context, job_file: str | None, options: dict[str, Any]) -> Any:
    from batchjob.job.spec import make_spec

    given = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in options.items()
        if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT) and v not in ((), None)
    }
    if "choices" in given:  # repeated, each a comma-separated list: one list (the last alone was kept)
        given["choices"] = ",".join(given["choices"])
    for k in _ESCAPED:
        value = given.get(k)
        if isinstance(value, str):
            given[k] = _unescape(value)
        elif isinstance(value, list):  # --stop, repeated
            given[k] = [_unescape(v) if isinstance(v, str) else v for v in value]
    return make_spec(job_file, **given)


# Text options whose \n and \t a shell passes on as typed: read as a job file's TOML string reads them, so
# the prompt a user copies from a job file to the command line is the same prompt.
_ESCAPED = ("template", "system", "stop")  # as a job file's TOML strings read them
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` in ``text`` as a newline, a tab and a backslash; any other backslash as is."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


@main.command(epilog=EXIT_CODES)
@_job_options
@_shard_options
@_launch_options
@click.pass_context
@_errors
def run(
    ctx: click.Context,
    job_file: str | None,
    num_shards: int | None,
    shard_index: int | None,
    devices: str | None,
    ray_address: str | None,
    **options: Any,
) -> None:
    """Run a job, or resume it: the same command on the same --output continues where it stopped.

    Options override the fields of JOB_FILE (TOML, the same names with _ or -; relative paths in it are
    relative to its folder). Temperature defaults to 0 (greedy): labeling jobs want the same answer twice.

    Several workers (--num-shards, a Slurm array, torchrun, --devices, --ray) share one --output: each owns
    a fixed share of the rows and keeps its own parts and state; `batchjob status DIR` adds them up.
    """
    import os

    from batchjob.job.runner import run_job
    from batchjob.job.shard import detect_shard

    spec = _spec(ctx, job_file, options)
    if devices is not None or ray_address is not None:
        ctx.exit(_launch(ctx, spec, num_shards, shard_index, devices, ray_address))
    shard = detect_shard(os.environ, num_shards, shard_index)
    if not shard.single:
        click.echo(f"batchjob: {shard} (from {shard.origin})", err=True)
    result = run_job(spec, shard=shard)
    if result.status == "already complete":
        click.echo(
            f"job already complete: {result.rows_done} rows ({result.errors} errors) in {result.out_dir}"
        )
        return
    s = result.stats
    total = f" of {result.rows_total}" if result.rows_total is not None else ""
    rows = s.get("rows", 0)
    samples = s.get("samples", rows)
    outputs = f" ({samples} samples)" if samples != rows else ""  # --n: input rows, and their outputs
    if spec.engine.task == "generate":
        tokens = f"{s.get('generated_tokens', 0)} tokens in {s.get('elapsed_s', 0):.1f} s "
        tokens += f"({s.get('generated_tokens_per_s', 0):.1f} tok/s)"
    else:  # prefill-only: the tokens read are the work
        tokens = f"{s.get('prompt_tokens', 0)} tokens read in {s.get('elapsed_s', 0):.1f} s "
        tokens += f"({s.get('total_tokens_per_s', 0):.1f} tok/s, {s.get('rows_per_s', 0):.1f} rows/s)"
    click.echo(
        f"{result.status}: {result.rows_done}{total} rows done ({result.errors} errors); this run: "
        f"{rows} rows{outputs}, {tokens} -> {result.out_dir}"
    )
    if result.exit_code:
        click.echo("state saved; run the same command again to resume", err=True)
        ctx.exit(result.exit_code)


def _launch(
    ctx: click.Context,
    spec: Any,
    num_shards: int | None,
    shard_index: int | None,
    devices: str | None,
    ray_address: str | None,
) -> int:
    import os

    from batchjob.errors import ConfigError
    from batchjob.job.launch import (
        parse_devices,
        run_devices,
        run_ray,
        saved_num_shards,
        worker_devices,
        worst_exit,
    )
    from batchjob.job.prepare import prepare
    from batchjob.job.shard import detect_shard, scheduler_workers

    if devices is not None and ray_address is not None:
        raise ConfigError("give --devices or --ray, not both")
    if ctx.get_parameter_source("device") not in (None, ParameterSource.DEFAULT):
        raise ConfigError("--device sets one worker's device; with --devices or --ray leave it out")
    if ray_address is not None:
        if shard_index is not None:
            raise ConfigError("--ray starts every shard itself: leave out --shard-index")
        if scheduler_workers(os.environ):
            raise ConfigError(
                f"--ray starts every shard itself, but {' '.join(scheduler_workers(os.environ))} make this "
                "process one of several workers, each of which would run the whole job: start the --ray "
                "launcher once (one task), or leave --ray out and let the scheduler's tasks be the workers"
            )
        count = num_shards or saved_num_shards(Path(spec.output or "")) or 1
        prepare(spec, shard=detect_shard({}, count, 0))  # fail early, once
        codes = run_ray(spec, ray_address or None, num_shards)
    else:
        device_list = parse_devices(devices or "")
        outer = detect_shard(os.environ, num_shards, shard_index)
        ranks = spec.engine.tensor_parallel_size or 1  # each worker takes that many devices
        n = len(worker_devices(device_list, ranks))
        prepare(spec, shard=detect_shard({}, outer.count * n, outer.index * n))  # fail early, once
        codes = run_devices(device_list, outer, _worker_args(ctx), ranks)
    return worst_exit(codes)


@main.command(epilog=EXIT_CODES)
@_job_options
@_shard_options
@click.pass_context
@_errors
@click.option(
    "--estimate",
    is_flag=True,
    help="Also tokenize the prompts (a histogram of their lengths, the rows that will fail) and time a short "
    "calibration run: the job's expected time on this machine, and with other --max-num-seqs and "
    "--max-num-batched-tokens (loads the model; the calibration takes about 20 s).",
)
@click.option(
    "--estimate-rows",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    metavar="N",
    help="Rows looked at for --estimate (from the start; the rest is extrapolated).",
)
def validate(
    ctx: click.Context,
    job_file: str | None,
    num_shards: int | None,
    shard_index: int | None,
    estimate: bool,
    estimate_rows: int,
    **options: Any,
) -> None:
    """Check a job (options, inputs, columns, model, saved state) without running it."""
    import os

    from batchjob.job.prepare import prepare
    from batchjob.job.runner import check_engine
    from batchjob.job.shard import detect_shard

    spec = _spec(ctx, job_file, options)
    shard = detect_shard(os.environ, num_shards, shard_index)
    prep = prepare(spec, shard=shard)
    for skipped in prep.skipped:  # the one discovery rule (docs/inputs.md), made visible
        click.echo(f"skipped {skipped}")
    engine = check_engine(spec)
    _check_tokenizer(prep)
    state = "starts a new job in"
    if prep.resumed:
        state = "finds the job complete in" if prep.info.complete else "resumes the job in"
    for line in prep.taken:
        click.echo(f"--append: {line}")
    click.echo(
        f"ok: {len(prep.sources)} input file(s), columns {', '.join(prep.info.schema.names)}; "
        f"prompt from {prep.plan.kind} {prep.plan.column or prep.plan.template!r}; {engine}; "
        f"{state} {prep.out_dir}"
    )
    if spec.image_column is not None:
        _check_images(prep)
    if estimate and prep.info.complete:
        click.echo("estimated time: 0 s (the job is complete: nothing is left to run)")
    elif estimate:
        from batchjob.job.estimate import estimate as run_estimate

        for line in run_estimate(prep, max_rows=estimate_rows).lines():
            click.echo(line)


def _check_images(prep: Any) -> None:
    """--image-column: every image read and decoded; the ones that can't be, named (their rows' errors)."""
    from batchjob.job.images import unreadable

    spec = prep.spec
    fetch = None if prep.remote is None else prep.remote.get
    total, bad, lines = unreadable(prep.sources, spec.image_column, spec.max_image_pixels, fetch=fetch)
    some = f"{bad} of {total} can't be opened (their rows will be error rows)"
    click.echo(f"images: {some}" if bad else f"images: all {total} open")
    for line in lines:
        click.echo(f"  {line}")
    if bad > len(lines):
        click.echo(f"  ... and {bad - len(lines)} more")
    from batchjob.job.image_memory import memory_lines
    from batchjob.models import load_config

    for line in memory_lines(prep, load_config(spec.model, spec.trust_remote_code)[0]):
        click.echo(line)


def _check_tokenizer(prep: Any) -> None:
    from batchjob.job.checks import check_tokenizer_texts  # (a command's modules load when it runs)
    from batchjob.job.rows.images import check_job_render  # (loads the processor only for image rows)
    from batchjob.job.rows.reasoning import think_tags
    from batchjob.models import load_config, load_tokenizer

    tokenizer = load_tokenizer(prep.spec.model, prep.spec.trust_remote_code)
    plan = prep.plan.for_tokenizer(prep.spec, bool(getattr(tokenizer, "chat_template", None)))
    # a VLM's job is rendered by its processor (check_job_render, check_job_kwargs)
    config = load_config(prep.spec.model, prep.spec.trust_remote_code)[0]
    if prep.spec.template_kwargs:  # the keys its chat template never reads, as a run refuses them
        from batchjob.job.chat_kwargs import check_job_kwargs

        check_job_kwargs(prep.spec, prep.plan, tokenizer, config, prep.resumed)
    # a template that rejects or drops --system, as a run refuses it (a VLM's job: its processor's template)
    check_job_render(prep.spec, plan, tokenizer, config)
    check_tokenizer_texts(prep.spec.stop, prep.spec.choices, tokenizer)
    think_tags(prep.spec, tokenizer)  # --reasoning-tags the tokenizer refuses, --max-reasoning-tokens without


@main.command()
@click.argument("dir", type=click.Path())
@_errors
def status(dir: str) -> None:
    """Report a job's progress from its output folder: rows done of total, errors, throughput.

    A job split over several workers is added up, with a line per worker. Every part is checked (exists,
    recorded size, footer row count, and its content digest if the file was touched since it was
    committed): a missing or damaged one is named and its rows are not counted as done (the job is
    incomplete; `batchjob run` with the same command redoes them).
    """
    from batchjob.job.status import job_status

    for line in job_status(Path(dir)).lines(dir):
        click.echo(line)


@main.command()
@click.argument("dir", type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "csv", "openai"]),
    default="jsonl",
    show_default=True,
    help="jsonl: one JSON object per result row; csv: a header and a line per row (nested values as JSON); "
    "openai: the OpenAI Batch output format, one line per request (its samples as choices).",
)
@click.option("--to", "to", metavar="FILE", help="Write here (default: standard output).")
@_errors
def export(dir: str, fmt: str, to: str | None) -> None:
    """Write a job's results in input order (by file, then row), streaming: any size, flat memory.

    Reads what is committed: an unfinished job exports the rows done so far (and says so on stderr).
    """
    from batchjob.job.export import export_to
    from batchjob.job.status import job_status

    st = job_status(Path(dir))
    n, where = export_to(Path(dir), fmt, to)
    what = "requests" if fmt == "openai" else "rows"
    click.echo(f"exported {n} {what} to {where}", err=True)
    if not st.complete:
        click.echo(
            f"the job is not complete: {st.total('rows_done')} of {st.rows_total or 'unknown'} input rows "
            f"are done; {st.next_step()}",
            err=True,
        )


@main.command()
@click.argument("dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--to", "to", metavar="FILE", help="Where to write the page (default: DIR/_batchjob/report.html)."
)
@_errors
def report(dirs: tuple[str, ...], to: str | None) -> None:
    """Draw a job's progress and results into one self-contained HTML page (images embedded), and print
    its path. Two output folders (a static-batching run and a continuous one, say) are drawn side by side.
    Works on a running or killed job: it reads what is committed."""
    from batchjob.job.report import build

    click.echo(build([Path(d) for d in dirs], Path(to) if to else None))


from batchjob import bench as _bench  # noqa: E402,F401  (registers "batchjob bench", "bench-scheduling")
