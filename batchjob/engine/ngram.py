"""Prompt lookup's state, kept on ``Request.spec``: where each n-gram of a request's tokens last occurred, and
how often its drafts were kept (the decisions are in :mod:`.speculative`). Imports nothing of the engine, so
the request can name its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_SIZES = (3, 2)  # longest match first
PRIOR_WEIGHT = 2.0  # a request's kept rate starts as the engine's, worth this many verified drafts
REQUEST_DECAY = 0.8  # a request's evidence fades by this at each verification: its text changes as it goes


class NgramIndex:
    """Where each n-gram of a request's tokens last occurred, kept up to date as tokens are added."""

    __slots__ = ("last", "indexed")

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.indexed = 0  # n-grams ending before this index are in ``last``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n-gram."""
        end = len(tokens)
        for e in range(max(self.indexed, 1), end):  # n-grams followed by a token: ending at e < end
            for n in NGRAM_SIZES:
                if e >= n:
                    self.last[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)
        for n in NGRAM_SIZES:
            if end > n:
                e = self.last.get(tuple(tokens[end - n :]))
                if e is not None:
                    return tokens[e : e + k]
        return []


class KeptRate:
    """How often a verified draft is kept (a draft after the first counts only when the one before it was
    kept): faded counts of kept drafts and of rejections, read over a prior."""

    __slots__ = ("kept", "rejected", "decay")

    def __init__(self, decay: float) -> None:
        self.kept = 0.0
        self.rejected = 0.0
        self.decay = decay

    def add(self, proposed: int, kept: int) -> None:
        self.kept = self.decay * self.kept + kept
        self.rejected = self.decay * self.rejected + (kept < proposed)

    def rate(self, prior: float = 0.5, weight: float = PRIOR_WEIGHT) -> float:
        return (self.kept + weight * prior) / (self.kept + self.rejected + weight)


@dataclass
class SpecState:
    """A request's prompt-lookup state, from its first chance to draft on."""

    ngrams: NgramIndex = field(default_factory=NgramIndex)  # of its tokens
    kept: KeptRate = field(default_factory=lambda: KeptRate(REQUEST_DECAY))
    idle: int = 0  # steps it could have drafted since it last did
