"""The stop check's plain rules: end of sequence and stop token ids, stop strings (their scan is
``stop_strings.py``'s, their text cut ``output.py``'s), and the lengths (``max_new_tokens``, the context).
"""

from __future__ import annotations

from batchjob.engine.features.base import Limits, StopRule
from batchjob.engine.request import Request, RequestStatus


class EndOfSequence(StopRule):
    """The model's end-of-sequence ids (unless ``ignore_eos``) and the request's ``stop_token_ids``."""

    def __init__(self, engine: Limits) -> None:
        self.engine = engine

    def stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        eos = not p.ignore_eos and token in self.engine.eos_token_ids
        if eos or (p.stop_token_ids and token in p.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        return None


class StopStrings(StopRule):
    """The request's stop strings, looked for in its text as it grows."""

    def __init__(self, engine: Limits) -> None:
        self.engine = engine

    def stop(self, req: Request, token: int) -> RequestStatus | None:
        if req.params.stop and self.engine.output.stop_string_found(req):
            return RequestStatus.FINISHED_STOPPED
        return None

    def error(self, req: Request) -> str | None:
        return special_in_stop(req.params.stop, self.engine.output.special_tokens)


def held_special(texts: list[str] | None, special_tokens: list[str]) -> tuple[str, str] | None:
    """The first of ``texts`` that holds a special token's text (the output text leaves such tokens out),
    with that token's text; or None."""
    return next(((x, t) for x in texts or () for t in special_tokens if t in x), None)


def special_in_stop(stops: list[str] | None, special_tokens: list[str]) -> str | None:
    """Why a stop string holding a special token's text is refused (the output text leaves special tokens
    out, so it would never be found), or None."""
    held = held_special(stops, special_tokens)
    if held is None:
        return None
    return (
        f"stop string {held[0]!r} holds the special token {held[1]!r}, which the output text leaves out, so "
        "it would never be found: stop on the token's id (stop_token_ids) instead"
    )


def special_in_choices(choices: list[str] | None, special_tokens: list[str]) -> str | None:
    """Why a choice holding a special token's text is refused, or None. The label's tokens then hold the
    token itself: where the model answers 'y' 0.5, 'y</s>' read its 'y' then its end (0.45) and 'y' beside
    it only 'y' then no end (0.05); '</s>' alone read the model's end with no answer."""
    held = held_special(choices, special_tokens)
    if held is None:
        return None
    return (
        f"the choice {held[0]!r} holds the special token {held[1]!r}, which the output text leaves out: it "
        "would be scored as that token (the end of the answer, for an end-of-sequence token), not as its "
        "text; spell the label without it"
    )


class Lengths(StopRule):
    """``max_new_tokens`` output tokens, or the model's context, whichever comes first."""

    def __init__(self, engine: Limits) -> None:
        self.engine = engine

    def stop(self, req: Request, token: int) -> RequestStatus | None:
        full = req.num_tokens >= self.engine.max_model_len
        if req.num_output_tokens >= req.params.max_new_tokens or full:
            return RequestStatus.FINISHED_LENGTH
        return None
