"""The continuous-batching engine: token ids in, token ids out. It knows nothing about files or jobs."""

from batchjob.engine.engine import Engine, EngineStats, RequestOutput, RequestState

__all__ = ["Engine", "EngineStats", "RequestOutput", "RequestState"]
