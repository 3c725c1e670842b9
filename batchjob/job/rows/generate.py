"""The generate row: one prompt sampled ``--n`` times (one request, or one per sample when resumed), written
once every sample is done; with a reasoning model whose thinking runs in the same request, each sample's text
is split into its ``reasoning`` and its answer.

A row whose thinking runs as a request of its own is ``reasoning.py``'s, a kind of this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchjob.job.checkpoint import InFlight
from batchjob.job.rows.base import Ask, RowWork, request_error

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput
    from batchjob.engine.request import RequestState
    from batchjob.job.reasoning import ReasoningTags
    from batchjob.sampling import SamplingParams

# a sample's token texts: ``spell(token_ids, top_ids)`` is the text of each of its tokens in context, and of
# each of ``top_ids[i]`` in place of token i (--logprobs; ``token_texts.TokenTexts.spell``)
Spell = Callable[[list[int], list[list[int]]], tuple[list[str], list[list[str]]]]


def spell_ids(ids: list[int], tops: list[list[int]]) -> tuple[list[str], list[list[str]]]:
    """Token texts without a tokenizer: each token's id (a row kind built on its own, as tests do)."""
    return [str(t) for t in ids], [[str(t) for t in top] for top in tops]


@dataclass(eq=False, kw_only=True)
class Samples(RowWork):
    """A generate row: ``params.n`` samples of one prompt."""

    kind = "generate"
    params: SamplingParams  # of the row's request in the engine (a reasoning row's: of its thinking)
    tags: ReasoningTags | None = None  # the model's think tags: a reasoning column
    spell: Spell = spell_ids  # a sample's token texts (--logprobs): the job's ``TokenTexts.spell``
    every: bool = False  # jobs with per-row parameters save each row's parameters with its checkpoint
    inside: bool = False  # the prompt ends inside a think block (the chat template opened it)
    saved: dict[int, list[int]] = field(default_factory=dict)  # tokens restored from the last checkpoint

    @property
    def expected(self) -> int:
        return self.params.n

    def asks(self) -> list[Ask]:
        """Resumed with several samples: each from its saved tokens (or afresh); else one request."""
        p = self.params
        if p.n > 1 and self.saved:
            return [Ask(self.row_id, self.prompt_ids, p, self.saved.get(k), k) for k in range(p.n)]
        return [Ask(self.row_id, self.prompt_ids, p, self.saved.get(0))]

    def result(self, k: int, out: RequestOutput) -> dict[str, Any]:
        error = request_error(out)
        text, reasoning = None if error else out.text, None
        if self.tags is not None and text is not None:
            reasoning, text = self.tags.split(text, self.inside)
        return self._columns(out, text, reasoning, len(out.token_ids), error, self.params)

    def _columns(
        self,
        out: RequestOutput,
        text: str | None,
        reasoning: str | None,
        n_gen: int,
        error: str | None,
        params: SamplingParams,
    ) -> dict[str, Any]:
        return {
            "generated_text": text,
            "finish_reason": out.finish_reason,
            "num_generated_tokens": n_gen,
            "error": error,
            "reasoning": reasoning,
            "adapter": self.adapter,
        } | feature_columns(out, params.logprobs, self.spell)

    @property
    def restored_tokens(self) -> int:
        return sum(len(ids) for ids in self.saved.values())

    def restore(self, saved: InFlight | None) -> None:
        """The saved tokens of each sample, when the record is this row's work (same id, kind, prompt and
        parameters, and as many samples); else the row starts afresh."""
        p = self.params
        if saved is None or saved.several != (p.n > 1):
            return
        if saved.matches(self.row_id, self.prompt_ids, p.to_dict(), self.kind):
            self.saved = saved.samples

    def in_flight(self, states: list[tuple[int | None, RequestState]]) -> InFlight | None:
        """Each sample's tokens so far (--n: finished samples that wait for their siblings are not saved:
        they are recomputed on resume, with the same tokens, being seeded)."""
        if not states:
            return self._record(self.prompt_ids, self.saved) if self.saved else None
        samples = {state.sample_index: list(state.output_ids) for _, state in states}
        return self._record(list(states[0][1].prompt_ids), samples)

    def _record(self, prompt: list[int], samples: dict[int, list[int]]) -> InFlight:
        params = self.params.to_dict() if self.every else None
        return InFlight(
            self.row.ordinal, self.row_id, prompt, dict(samples), params, self.params.n > 1, self.kind
        )


def feature_columns(out: RequestOutput, top_k: int | None = None, spell: Spell = spell_ids) -> dict[str, Any]:
    """The feature columns of one engine output: ``choice_*`` as ``{label: value}`` (Arrow maps), ``logprobs``
    as a list of per-token structs (``top_k``: the request's K; ``spell``: the sample's token texts)."""
    choice_lp, choice_p, logprobs = out.choice_logprobs, out.choice_probs, out.logprobs
    return {
        "sample_index": out.sample_index,
        "choice_logprobs": None if choice_lp is None else dict(choice_lp),
        "choice_probs": None if choice_p is None else dict(choice_p),
        "logprobs": None
        if logprobs is None
        else token_logprobs(logprobs, list(out.token_ids), top_k or 0, spell),
    }


def token_logprobs(
    tops: list[list[tuple[int, float]]], token_ids: list[int], k: int, spell: Spell
) -> list[dict[str, Any]]:
    """The engine's per-token lists (the top ``k``, best first, then the sampled token's when it is not among
    them) as one struct per generated token: the sampled token, its log-prob, and the top ``k``. Their texts
    are spelled once for the sample, each token in the context of those before it (``spell``)."""
    pairs = list(zip(tops, token_ids, strict=True))  # one each: a list off by one would shift every token
    texts, top_texts = spell([t for _, t in pairs], [[t for t, _ in top[:k]] for top, _ in pairs])
    out = []
    for (top, token_id), text, alts in zip(pairs, texts, top_texts, strict=True):
        chosen = next((lp for t, lp in reversed(top) if t == token_id), float("nan"))
        entries = [
            {"token": a, "token_id": t, "logprob": lp} for (t, lp), a in zip(top[:k], alts, strict=True)
        ]
        out.append({"token": text, "token_id": token_id, "logprob": chosen, "top_logprobs": entries})
    return out
