"""The continuous-batching engine: token ids in, token ids out. It knows nothing about files or jobs.

Its names are imported on first use, so that reading the engine's option declarations (``options.py``, as the
command line does) loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchjob.engine.engine import Engine, EngineStats, RequestState
    from batchjob.engine.output import RequestOutput

__all__ = ["Engine", "EngineStats", "RequestOutput", "RequestState"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from batchjob.engine import engine  # torch and the model code: loaded on first use (see above)

        return getattr(engine, name)
    raise AttributeError(f"module 'batchjob.engine' has no attribute {name!r}")
