"""batchjob: offline batch inference over large datasets, on our own continuous-batching engine.

The public API is ``Engine``, ``SamplingParams`` and ``RequestOutput``. They are imported lazily, so that
``batchjob status`` and ``batchjob validate`` start without loading torch and transformers, and so that the
``batchjob`` command installs its SIGTERM/SIGINT handlers here, before any heavy import (``signals.py``);
imported as a library, the package installs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchjob import signals as _signals

if _signals.started_as_command():  # the console script: `from batchjob.cli import main` brings us here first
    _signals.install()

if TYPE_CHECKING:
    from batchjob.engine import Engine, RequestOutput
    from batchjob.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("Engine", "RequestOutput"):
        from batchjob import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from batchjob.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
