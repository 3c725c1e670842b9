"""The command line: ``batchjob run``, ``status`` and ``validate``.

Each command parses its options, builds a JobSpec (job file first, command-line options on top), calls the
library, and maps our errors to exit codes in one place (``_errors``): no traceback for anything a user
controls. Other commands (``bench``) register themselves on the ``main`` group from their own modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from batchjob.errors import BatchjobError
from batchjob.job.spec import DTYPE_CHOICES

EXIT_CODES = """\b
Exit codes:
  0   the job is complete (or was already)
  1   the job stopped: --max-errors reached, unreadable state, another run holds DIR (state is saved)
  2   a usage error: bad option or job file, missing input or column, model not found, or a resume whose
      model, inputs, prompts or sampling differ from the saved job
  75  interrupted by SIGTERM/SIGINT: finished rows committed, in-flight requests saved; run the same
      command again to resume (EX_TEMPFAIL: "requeue me")"""


class _Failure(click.ClickException):
    """A one-line error with our exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchjobError as e:
            raise _Failure(str(e), e.exit_code) from e
        except OSError as e:  # disk full, permission denied: the world, not a bug
            raise _Failure(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "), 1) from e

    return wrapper


def _job_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.argument("job_file", required=False, type=click.Path(dir_okay=False)),
        click.option(
            "--input",
            "input",
            multiple=True,
            metavar="PATH",
            help="Input file, folder or glob (repeatable): .parquet, .jsonl[.gz|.zst], a "
            "datasets.save_to_disk folder, or s3:// gs:// hf:// with fsspec installed.",
        ),
        click.option(
            "--output", metavar="DIR", help="Output folder: Parquet parts, state under DIR/_batchjob."
        ),
        click.option(
            "--prompt-column",
            metavar="COL",
            help="Column whose text is the prompt (default: 'prompt' or 'text').",
        ),
        click.option("--messages-column", metavar="COL", help="Column holding a list of chat messages."),
        click.option(
            "--template", metavar="FMT", help='Prompt format string over columns, e.g. "Classify: {review}".'
        ),
        click.option("--system", metavar="TEXT", help="System message put before each prompt."),
        click.option(
            "--chat/--no-chat",
            default=None,
            help="Wrap each prompt as a user message in the chat template "
            "(default: on when the tokenizer has a chat template).",
        ),
        click.option(
            "--id-column", metavar="COL", help="Column of unique row ids (default: '<file>:<row>')."
        ),
        click.option(
            "--model", help="Local model folder or hub id (default: embedded SmolLM2-135M-Instruct)."
        ),
        click.option("--dtype", type=click.Choice(DTYPE_CHOICES), help="Weights dtype (default: auto)."),
        click.option("--device", help="auto, cpu, cuda or cuda:N (default: auto)."),
        click.option("--max-new-tokens", type=int, help="Tokens to generate per row at most (default: 128)."),
        click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy (default: 0)."),
        click.option("--top-p", type=float, help="Nucleus sampling threshold in (0, 1] (default: 1)."),
        click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 keeps all (default: 0)."),
        click.option(
            "--min-p", type=float, help="Drop tokens below min_p x the top probability (default: 0)."
        ),
        click.option(
            "--seed", type=int, help="Sampling seed; each row mixes in its id (default: one per job)."
        ),
        click.option("--stop", multiple=True, help="Stop string (repeatable); the text is cut before it."),
        click.option(
            "--max-num-batched-tokens", type=int, help="Tokens per engine step (default: per device)."
        ),
        click.option("--max-num-seqs", type=int, help="Requests running at once (default: per device)."),
        click.option("--block-size", type=int, help="Tokens per KV block (default: 16)."),
        click.option("--kv-memory-gb", type=float, help="KV cache budget in GiB (default: per device)."),
        click.option("--num-blocks", type=int, help="KV cache size in blocks (overrides --kv-memory-gb)."),
        click.option(
            "--gpu-memory-utilization",
            type=float,
            help="CUDA: share of GPU memory for weights, activations and KV (default: 0.9).",
        ),
        click.option(
            "--prefix-caching/--no-prefix-caching",
            default=None,
            help="Share the KV of equal prompt prefixes between rows (default: on).",
        ),
        click.option(
            "--admission",
            type=click.Choice(["fcfs", "longest-first", "shortest-first", "static"]),
            help="Order rows enter the engine: input order, longest or shortest prompt first within "
            "--lookahead rows, or static batches (a baseline) (default: fcfs).",
        ),
        click.option(
            "--lookahead",
            type=int,
            metavar="ROWS",
            help="Rows read ahead for longest-first / shortest-first (default: 512).",
        ),
        click.option(
            "--checkpoint-interval",
            type=float,
            metavar="SECONDS",
            help="Seconds between in-flight checkpoints (default: 30).",
        ),
        click.option(
            "--max-errors", type=int, metavar="N", help="Stop (exit 1, state saved) once N rows failed."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _spec(ctx: click.Context, job_file: str | None, options: dict[str, Any]) -> Any:
    from batchjob.job.spec import make_spec

    given = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in options.items()
        if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT) and v not in ((), None)
    }
    return make_spec(job_file, **given)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchjob")
def main() -> None:
    """batchjob: offline batch inference over large datasets, resumable, Parquet out."""


@main.command(epilog=EXIT_CODES)
@_job_options
@click.pass_context
@_errors
def run(ctx: click.Context, job_file: str | None, **options: Any) -> None:
    """Run a job, or resume it: the same command on the same --output continues where it stopped.

    Options override the fields of JOB_FILE (TOML, the same names with _ or -; relative paths in it are
    relative to its folder). Temperature defaults to 0 (greedy): labeling jobs want the same answer twice.
    """
    from batchjob.job.runner import run_job

    spec = _spec(ctx, job_file, options)
    result = run_job(spec)
    if result.status == "already complete":
        click.echo(
            f"job already complete: {result.rows_done} rows ({result.errors} errors) in {result.out_dir}"
        )
        return
    s = result.stats
    total = f" of {result.rows_total}" if result.rows_total is not None else ""
    click.echo(
        f"{result.status}: {result.rows_done}{total} rows done ({result.errors} errors); this run: "
        f"{s.get('rows', 0)} rows, {s.get('generated_tokens', 0)} tokens in {s.get('elapsed_s', 0):.1f} s "
        f"({s.get('generated_tokens_per_s', 0):.1f} tok/s) -> {result.out_dir}"
    )
    if result.exit_code:
        click.echo("state saved; run the same command again to resume", err=True)
        ctx.exit(result.exit_code)


@main.command(epilog=EXIT_CODES)
@_job_options
@click.pass_context
@_errors
def validate(ctx: click.Context, job_file: str | None, **options: Any) -> None:
    """Check a job (options, inputs, columns, model, saved state) without running it."""
    from batchjob.job.runner import prepare

    spec = _spec(ctx, job_file, options)
    prep = prepare(spec)
    _check_tokenizer(prep)
    state = "resumes the job in" if prep.resumed else "starts a new job in"
    click.echo(
        f"ok: {len(prep.sources)} input file(s), columns {', '.join(prep.info.schema.names)}; "
        f"prompt from {prep.plan.kind} {prep.plan.column or prep.plan.template!r}; {state} {prep.out_dir}"
    )


def _check_tokenizer(prep: Any) -> None:
    from batchjob.errors import ModelNotFoundError
    from batchjob.job.prompts import plan_prompts
    from batchjob.models import resolve_model

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(prep.spec.model))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load the tokenizer of model {prep.spec.model!r}: {e}") from e
    plan_prompts(prep.spec, prep.info.schema.names, bool(getattr(tokenizer, "chat_template", None)))


@main.command()
@click.argument("dir", type=click.Path())
@_errors
def status(dir: str) -> None:
    """Report a job's progress from its output folder: rows done of total, errors, throughput."""
    from batchjob.errors import InputError
    from batchjob.io.atomic import read_json
    from batchjob.job.manifest import Manifest
    from batchjob.job.state import StateDir

    state = StateDir(Path(dir))
    if not state.exists():
        raise InputError(f"{dir} holds no batchjob job (no {state.job_file})")
    info = state.load_job()
    manifest = Manifest(state.manifest_file)
    stats = read_json(state.stats_file) if state.stats_file.exists() else {}
    total = info.total_rows or (stats.get("job") or {}).get("rows_total")
    done = manifest.rows
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    click.echo(f"{dir}: {'complete' if info.complete else 'incomplete'}")
    click.echo(f"rows: {done} of {total if total is not None else 'unknown'}{pct}")
    click.echo(f"errors: {manifest.errors}")
    click.echo(f"tokens: {manifest.prompt_tokens} in, {manifest.generated_tokens} out")
    if stats:
        click.echo(
            f"last run: {stats.get('rows', 0)} rows in {stats.get('elapsed_s', 0):.1f} s, "
            f"{stats.get('generated_tokens_per_s', 0):.1f} generated tok/s, "
            f"{stats.get('preemptions', 0)} preemptions"
        )
    click.echo(f"parts: {len(manifest.parts)}; stats: {state.stats_file}")


from batchjob import bench as _bench  # noqa: E402,F401  (registers "batchjob bench")
