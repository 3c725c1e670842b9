"""Text at the engine's edge: token ids become text, stop strings end requests, finished requests become
``RequestOutput``s with their finish reason in words.

The engine core decides by token ids (EOS, stop token ids, lengths, constraints); stop strings are the one
rule about text, and it asks :meth:`OutputProcessor.stop_string_found` after each token (the incremental
search is :class:`~.stop_strings.StopScan`'s).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from batchjob.engine import choices
from batchjob.engine.constraints import ChoiceConstraint, GrammarConstraint, normalize_choices
from batchjob.engine.grammar import answer_error
from batchjob.engine.request import Request, RequestStatus
from batchjob.engine.stop_strings import StopScan, window_safe

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


def cut_short(req: Request) -> str | None:
    """Why a constrained request that ran out of tokens (its limit, or the context's end) has no answer: its
    JSON schema or regex was not complete, or no choice was (a cut answer, ``{"a"`` or ``y`` of ``yes``,
    would read as the model's); None when it has one, or no constraint."""
    c = req.constraint
    if isinstance(c, ChoiceConstraint):
        return (
            f"the context ended ({req.num_tokens} tokens) before a choice was complete: shorten the prompt "
            "or raise --max-model-len"
        )
    if not isinstance(c, GrammarConstraint) or c.matcher.is_accepting():
        return None
    what = "JSON schema" if req.params.json_schema is not None else "regex"
    n, limit = req.num_output_tokens, req.params.max_new_tokens
    ended = (
        f"the context ended ({req.num_tokens} tokens: {req.num_prompt_tokens} before the answer, {n} of it)"
    )
    if n < limit:  # the context cut it first: raising max_new_tokens would change nothing
        return f"{ended} before its {what} was complete: shorten the prompt or raise --max-model-len"
    reached = f"the answer reached its token limit ({n} tokens, max_new_tokens {limit})"
    if c.room is not None and n >= c.room:  # both at once: either alone would still cut it
        return (
            f"{reached} as {ended} before its {what} was complete: raise max_new_tokens, and shorten the "
            "prompt or raise --max-model-len"
        )
    return f"{reached} before its {what} was complete: raise max_new_tokens"


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None
    arrival_time: float  # monotonic seconds, like the times below
    first_token_time: float | None
    finish_time: float
    sample_index: int = 0  # which of the prompt's n samples this is
    choice_logprobs: dict[str, float] | None = None  # with choices: log P(choice | prompt), each choice
    logprobs: list[list[tuple[int, float]]] | None = None  # with logprobs=K: per generated token
    first_scheduled_time: float | None = None  # when it first ran in a step (None: it never ran)
    stopped_at_string: bool = False  # a stop string ended it (``text`` ends before it; the tokens may not)
    # Prefill-only tasks (tasks.py documents each); None for generation and for errors.
    embedding: np.ndarray | None = None  # embed: [D]
    logits: np.ndarray | None = None  # classify: [L] the head's raw outputs
    probs: np.ndarray | None = None  # classify, L > 1: softmax of logits (multi-label: sigmoid of each)
    label: str | None = None  # classify, L > 1: id2label of the largest
    labels: list[str] | None = None  # classify, multi-label head: id2label of each label above 0.5
    score: float | None = None  # classify, L == 1: the one output
    logprob: float | None = None  # score: sum of the scored tokens' log-probabilities
    num_scored_tokens: int | None = None  # score
    token_logprobs: list[float] | None = None  # score, when asked for: one per scored token

    @property
    def perplexity(self) -> float | None:
        """score: exp(-logprob / num_scored_tokens)."""
        if self.logprob is None or self.num_scored_tokens is None:
            return None
        return math.exp(-self.logprob / self.num_scored_tokens) if self.num_scored_tokens else math.nan

    @property
    def choice_probs(self) -> dict[str, float] | None:
        """With choices: each choice's probability renormalised over the choices (they sum to 1)."""
        return None if self.choice_logprobs is None else normalize_choices(self.choice_logprobs)


def special_token_texts(tokenizer) -> list[str]:
    """The texts of the special tokens the output text leaves out (not a lone space or letter)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {str(t) for t in added.values() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_tokens", ()))
    return sorted(t for t in special if len(t.strip()) > 1)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Whether stop strings may be looked for in a window of the latest tokens, else in the whole output
        self.window_safe = window_safe(tokenizer)  # (stop_strings.py)
        # The texts of the tokens the output text leaves out (a stop string holding one is refused)
        self.special_tokens = special_token_texts(tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_string_found(self, req: Request) -> bool:
        """Whether the request's output, up to its last token, contains one of its stop strings; the first
        one's position is kept for its text (stop_strings.py)."""
        stops = req.params.stop
        if not stops:
            return False
        if req.stop is None:
            req.stop = StopScan(longest=max(len(s) for s in stops), whole=not self.window_safe)
        return req.stop.found(req.token_ids, req.num_prompt_tokens, stops, self.decode)

    def output(self, req: Request) -> RequestOutput:
        token_ids = req.output_ids
        text = self.decode(token_ids) if token_ids else ""
        if req.stop is not None and req.stop.match is not None:
            text = text[: req.stop.match]
        choice_logprobs, chosen, error = None, False, req.error
        logprobs = None if req.logprobs is None else req.logprobs.top
        if choices.is_choice(req):
            answer = choices.answer(req)
            choice_logprobs, error = answer.logprobs, error or answer.error
            if answer.token_ids is not None and answer.text is not None:
                token_ids, text, chosen = answer.token_ids, answer.text, True
                logprobs = logprobs if answer.top is None else answer.top
        req.finish_time = time.monotonic()
        finish = FINISH_REASONS.get(req.status, "error")
        finish = "error" if error is not None else finish  # (a helper's finding, after its owner stopped)
        if finish == "length" and not chosen and (cut := cut_short(req)) is not None:
            finish, error = "error", cut
        elif error is None and isinstance(req.constraint, GrammarConstraint):
            p = req.params
            if (bad := answer_error(p.json_schema, p.regex, text)) is not None:
                finish, error = "error", bad
            elif req.constraint.steered:  # closed by the engine near max_new_tokens, not by the model
                finish = "length"
        return RequestOutput(
            request_id=req.group_id,
            prompt_ids=req.prompt_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            error=error,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            sample_index=req.sample_index,
            choice_logprobs=choice_logprobs,
            logprobs=logprobs,
            first_scheduled_time=req.first_scheduled_time,
            stopped_at_string=req.stop is not None and req.stop.match is not None,
            **((req.task.result or {}) if req.task is not None else {}),
        )
