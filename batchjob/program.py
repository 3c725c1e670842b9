"""The ``batchjob`` program: the root click group, the mapping of our errors to exit codes, and the engine's
options as command-line flags.

``cli.py`` (run, validate, status, export, report) and ``bench/`` add their commands to ``main`` here; neither
imports the other's commands. Nothing heavy is imported: the command installs its signal handlers first.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click

from batchjob.engine.options import job_options
from batchjob.errors import BatchjobError


class Failure(click.ClickException):
    """A one-line error with our exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map what a user or the world controls to one line and an exit code: our errors carry theirs (2 for a
    usage error), a full disk or other OSError is 1. No traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchjobError as e:
            raise Failure(str(e), e.exit_code) from e
        except OSError as e:  # disk full, permission denied: the world, not a bug
            if isinstance(e, BrokenPipeError) and _stdout_gone(e):
                # `batchjob export OUT | head`: the reader has all it wanted; say nothing, as cat and grep do
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
                raise SystemExit(1) from None
            from batchjob.io.atomic import disk_full_message, is_disk_full

            if is_disk_full(e):
                where = e.filename or (f"under {kwargs['output']}" if kwargs.get("output") else None)
                raise Failure(disk_full_message(e, where), 1) from e
            raise Failure(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "), 1) from e

    return wrapper


def _stdout_gone(e: BrokenPipeError) -> bool:
    """Whether a broken pipe is our standard output's (a pipe, and no file named): its reader has gone."""
    try:
        return e.filename is None and stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def engine_flags(
    names: Iterable[str] | None = None, defaults: dict[str, Any] | None = None
) -> list[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """Click options for the engine's options (``engine/options.py``), by their job names: ``names`` (default:
    every one jobs have), each with its declared help and type. Left out, an option's value is None (the
    job file's, else the engine's default decides) unless ``defaults`` gives one; the checks run where the
    values are used (``JobSpec``, ``EngineConfig``), with the messages the library gives."""
    wanted = None if names is None else set(names)
    defaults = defaults or {}
    options = []
    for name, _, opt in job_options():
        if wanted is not None and name not in wanted:
            continue
        flag = "--" + name.replace("_", "-")
        kw: dict[str, Any] = {"help": opt.help, "default": defaults.get(name)}
        if name in defaults:  # this command's own default, shown instead of the engine's
            kw["help"] = re.sub(r" \(default: .*\)\.$", ".", opt.help)
            kw["show_default"] = True
        if opt.kind is bool:
            decls = [f"{flag}/--no-{flag[2:]}", name]
        else:
            decls = [flag, name]
            kw["type"] = click.Choice(opt.choices) if opt.choices else opt.kind
            if opt.metavar:
                kw["metavar"] = opt.metavar
        options.append(click.option(*decls, **kw))
    return options


def apply(options: list[Callable[[Callable[..., Any]], Callable[..., Any]]]) -> Callable[..., Any]:
    """A decorator adding ``options`` (click's decorators) in their order."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


class _Program(click.Group):
    """The ``batchjob`` group. Called as a program (the console script, ``python -m batchjob``), it handles
    SIGTERM/SIGINT from the start: one that comes before the job loop runs exits 75 with one line."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from batchjob import faults, signals

        signals.install()  # already done by `import batchjob` or __main__; here for any other entry
        try:
            try:
                signals.arm()
                faults.point("startup")
                return super().__call__(*args, **kwargs)
            except signals.Interrupted as e:
                print(f"batchjob: {e}", file=sys.stderr)
                sys.exit(signals.EXIT_INTERRUPTED)
        except SystemExit:  # the process exits with the code decided: no signal may change it now
            signals.quiet()
            faults.at_exit("finalizing")
            raise

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None:
            _check_optional_values(cmd, rest)
        return name, cmd, rest


def _check_optional_values(cmd: click.Command, args: list[str]) -> None:
    """click reads ``--logprobs -1`` (and ``--logprobs=-1``) as the flag alone, then ``-1`` as an unknown
    option ("No such option '-1'"): for a number option that may be given alone, say what it takes."""
    numbers = {
        flag: p
        for p in cmd.params
        if isinstance(p, click.Option) and p._flag_needs_value and isinstance(p.type, click.types.IntParamType)
        for flag in p.opts
    }
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if flag in numbers and re.fullmatch(r"-\d+", value):
            given = f"{flag}={value}" if eq else f"{flag} {value}"
            raise click.UsageError(
                f"{given}: {flag} takes a whole number 0 or more, or nothing ({flag} alone: "
                f"{numbers[flag].flag_value})",
                ctx=None,
            )


@click.group(cls=_Program, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchjob")
@click.pass_context
def main(ctx: click.Context) -> None:
    """batchjob: offline batch inference over large datasets, resumable, Parquet out."""
    if ctx.invoked_subcommand != "run":
        from batchjob import signals

        signals.release()  # only `run` has state to save; the others keep Python's usual signals
