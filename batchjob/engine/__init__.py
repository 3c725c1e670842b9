"""The continuous-batching engine: token ids in, token ids out. It knows nothing about files or jobs."""

from batchjob.engine.engine import Engine, EngineStats, RequestState
from batchjob.engine.output import RequestOutput

__all__ = ["Engine", "EngineStats", "RequestOutput", "RequestState"]
