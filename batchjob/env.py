"""Reading the environment's on/off switches (``BATCHJOB_CPU_PREPACK=0``, ...) the same way everywhere."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def flag(name: str, default: bool = True) -> bool:
    """The switch ``name``: 0, false, no or off (any case) turn it off; 1, true, yes or on turn it on;
    anything else, or unset, leaves ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return default
