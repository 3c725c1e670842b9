"""Prompt lookup's state, kept on ``Request.spec``: where each n-gram of a request's tokens last occurred, and
how many drafts the request may propose next (the logic is in :mod:`.speculative`). Imports nothing of the
engine, so the request can name its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_SIZES = (3, 2)  # longest match first


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


@dataclass
class SpecState:
    """A request's prompt-lookup state, from its first draft on."""

    ngrams: NgramIndex = field(default_factory=NgramIndex)  # of its tokens
    backoff: int = 0  # steps left before it drafts again
    window: int = 1  # most drafts it may take next (slow start)
