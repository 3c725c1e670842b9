"""Reading the environment's on/off switches (``BATCHJOB_CPU_PREPACK=0``, ...) the same way everywhere.

Every switch is listed in ``FLAGS``; a value that is no on/off word is refused (``check_flags``, when an
engine's options are checked, before any work), never taken for the default: ``BATCHJOB_CPU_KERNEL=disable``
kept the kernel on without a word.
"""

from __future__ import annotations

import os

from batchjob.errors import ConfigError

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")
FLAGS = (  # each switch batchjob reads; all of them on unless turned off
    "BATCHJOB_CPU_KERNEL",
    "BATCHJOB_CPU_PREFILL",
    "BATCHJOB_CPU_LINEAR",
    "BATCHJOB_CPU_PREPACK",
    "BATCHJOB_CPU_JOINT",
    "BATCHJOB_CPU_ROWS",
    "BATCHJOB_CPU_HEAP",
    "BATCHJOB_CPU_SPIN_GUARD",
)


def flag(name: str, default: bool = True) -> bool:
    """The switch ``name``: 0, false, no or off (any case) turn it off; 1, true, yes or on turn it on; unset
    or empty leaves ``default``; anything else is refused (``ConfigError``)."""
    assert name in FLAGS, f"{name} is not listed in env.FLAGS"
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    if value:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an on/off value: set it to 0, false, no or off to turn "
            "it off, 1, true, yes or on to turn it on (any case), or unset it for the default"
        )
    return default


def check_flags() -> None:
    """Refuse, before any work, a switch of ``FLAGS`` set to a value that is no on/off word."""
    for name in FLAGS:
        flag(name)
