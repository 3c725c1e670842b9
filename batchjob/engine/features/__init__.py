"""Request features beside the generating core, on hooks (base.py): how a request stops after each token
(stops.py: end of sequence, stop strings, lengths; limits.py: a constraint's own bound), and a prompt's n
samples (samples.py). The per-step hooks (masks, log-probabilities, choice scores) are ``feature.py``'s.
"""

from __future__ import annotations

from batchjob.engine.features.base import Limits, StopRule
from batchjob.engine.features.limits import ConstraintLimits
from batchjob.engine.features.stops import EndOfSequence, Lengths, StopStrings

__all__ = ["Limits", "StopRule", "stop_rules"]


def stop_rules(engine: Limits) -> list[StopRule]:
    """The stop check's rules in the order they are asked: a constraint first (its answer may be complete,
    or bound its own length), then end of sequence and stop token ids, stop strings, and the lengths."""
    return [
        ConstraintLimits(engine),
        EndOfSequence(engine),
        StopStrings(engine),
        Lengths(engine),
    ]
