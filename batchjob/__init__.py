"""batchjob: offline batch inference over large datasets, on our own continuous-batching engine."""

from batchjob.engine import Engine, RequestOutput
from batchjob.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
