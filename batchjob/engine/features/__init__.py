"""Request features beside the generating core, on hooks: the per-step ones (``feature.py``'s
``RequestFeature``: log-probabilities, constraints' masks, choice scores) with the helper requests they
ask for (helpers.py); the stop rules after each token (base.py; stops.py: end of sequence, stop strings,
lengths; limits.py: a constraint's own bound); a prompt's n samples (samples.py). The engine builds its
lists here, so it names none of them.
"""

from __future__ import annotations

from batchjob.engine import logprobs
from batchjob.engine.choices import ChoiceScores
from batchjob.engine.feature import RequestFeature
from batchjob.engine.features.base import Limits, StopRule
from batchjob.engine.features.finite import FiniteLogits
from batchjob.engine.features.limits import ConstraintLimits
from batchjob.engine.features.stops import EndOfSequence, Lengths, StopStrings
from batchjob.engine.masks import Constraints
from batchjob.engine.penalties import RepetitionPenalty
from batchjob.engine.request import Request

__all__ = ["Limits", "StopRule", "output_to_resume", "step_features", "stop_rules"]


def step_features(
    tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int, penalty: float = 1.0
) -> list[RequestFeature]:
    """The per-step features in the order their hooks run: log-probabilities first (of the model's own
    distribution; a resumed request's replayed tokens replace the draw before a constraint takes them), the
    check that the drawn token's logit is finite, the repetition penalty (``penalty``: the model's),
    constraints (``max_model_len``: the context, which a JSON answer is steered to close before), choice
    scores."""
    return [
        logprobs.Logprobs(),
        FiniteLogits(),
        RepetitionPenalty(penalty),
        Constraints(tokenizer, vocab_size, eos_token_ids, max_model_len),
        ChoiceScores(),
    ]


def output_to_resume(req: Request) -> list[int]:
    """The output ids a checkpoint keeps of ``req`` (one still replaying its resumed tokens: all of them)."""
    return logprobs.output_to_resume(req)


def stop_rules(engine: Limits) -> list[StopRule]:
    """The stop check's rules in the order they are asked: a constraint first (its answer may be complete,
    or bound its own length), then end of sequence and stop token ids, stop strings, and the lengths."""
    return [
        ConstraintLimits(engine),
        EndOfSequence(engine),
        StopStrings(engine),
        Lengths(engine),
    ]
