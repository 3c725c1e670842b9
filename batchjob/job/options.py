"""How a job option is declared: ``job_option()`` makes a ``JobSpec`` field that carries its help text, its
default, its check and how it looks on the command line, so the field, the TOML key and the flag of
``batchjob run`` come from one declaration (``spec.py`` holds the table; ``cli.py`` builds the flags).

The engine's options are declared the same way in ``engine/options.py``; ``JobSpec`` holds them as one
``EngineOptions`` (``JobSpec.engine``), under their flat job names in job files and flags. This module imports
nothing heavy: the command line reads it to build its flags.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field
from typing import Any

from batchjob.engine.options import Check


@dataclass(frozen=True)
class JobOption:
    """How one job option appears outside ``JobSpec`` (``job_option()`` declares it)."""

    help: str  # the command line's help, without the default (``shown_help`` adds it)
    # What the default means, in words, where the value does not say it (None: what "the engine", the
    # tokenizer or the input decides); left out, a default that is a number or a word is shown as it is.
    default_help: str | None = None
    check: Check | None = None  # applied to every value given (None is never checked)
    choices: tuple[str, ...] = ()  # str options with a fixed set of values
    metavar: str | None = None
    multiple: bool = False  # the flag may be repeated (a list of strings)
    flag_value: Any = None  # the value of the flag given alone, for an option that may take one (--logprobs)
    cli_type: type | None = None  # the command line's type where it differs from the field's

    def complaint(self, name: str, value: Any) -> str | None:
        """What is wrong with ``value`` for the option called ``name``, in one line; None when fine."""
        if value is None or self.check is None:
            return None
        wrong = self.check(value)
        return None if wrong is None else f"{name} {wrong}"


def job_option(default: Any, help: str, **how: Any) -> Any:
    """A ``JobSpec`` field that is a job option: ``how`` is the rest of ``JobOption``. A list default is
    given as ``list`` (each spec gets its own)."""
    meta = {"job_option": JobOption(help, **how)}
    if default is list:
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


def shown(value: Any) -> str:
    """A default as the help shows it: on/off, 30 rather than 30.0."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def shown_help(f: Field[Any]) -> str:
    """The help of the job option declared by field ``f``, ending with its default: the declaration's
    words, else the default's value when it is a number or a word."""
    opt: JobOption = f.metadata["job_option"]
    default = opt.default_help
    if default is None and f.default is not MISSING and f.default is not None and f.default is not False:
        default = shown(f.default)
    if default is None:
        return opt.help
    return f"{opt.help.rstrip('.')} (default: {default})."


def at_least(lo: int, unit: str = "") -> Check:
    """A number at least ``lo`` (its type is checked before: ``JobSpec`` checks every field's)."""

    def check(value: Any) -> str | None:
        return None if value >= lo else f"must be >= {lo}{unit}, got {value!r}"

    return check


def positive(unit: str = "") -> Check:
    def check(value: Any) -> str | None:
        return None if value > 0 else f"must be > 0{unit}, got {value!r}"

    return check


def one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}; got {value!r}"

    return check
