"""--logprobs: each generated token's text as it stands in the output's text.

A token decoded alone is not its text in the output: a SentencePiece (Metaspace) tokenizer strips the word-start
space of the first token it decodes (``▁Pa`` alone is ``Pa``, after another token `` Pa``), and a token that
is one byte of a character decodes to U+FFFD. So a sample's tokens are spelled together, decoded as the
output's text is (``tokenizer.decode(ids, skip_special_tokens=True)``): a token's text is the decoding up to it
minus the decoding before it, over a short window of the tokens before it, so a token costs a few short decodes
whatever the output's length. The texts are checked to join to the decoding of them all; where the window
would not give that (a decoder's clean-up), each token is decoded after all those before it.

What holds (docs/labels.md says it too): the texts join to the decoding of the sample's tokens; a special token
(EOS) has an empty text; a character made of several tokens is the text of the token that completes it, those
before it empty (only a character the output leaves unfinished reads as U+FFFD, as in the text); a top token's
text is the one it would add in the sampled token's place.
"""

from __future__ import annotations

from typing import Any

UNFINISHED = "\ufffd"  # what a decoder writes for the bytes of a character it has not seen whole
_BYTES = 4  # a UTF-8 character's most bytes: tokens are held back for the rest of one at most this many
_WINDOW = 8  # the most tokens decoded before a token (the last one that added text, and those after it)


class TokenTexts:
    """A tokenizer's token texts in context: ``spell`` a sample's tokens (``generate.token_logprobs``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        """As the engine decodes its outputs (``OutputProcessor.decode``)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one text out
        return text

    def spell(self, ids: list[int], others: list[list[int]]) -> tuple[list[str], list[list[str]]]:
        """The text each of ``ids`` adds to the decoding of them all, and the text each of ``others[i]``
        would add in place of ``ids[i]`` (``others``: a list for each token). The first join to
        ``decode(ids)``: checked, and where the short window would not, each is decoded after all those
        before it (``_exact``)."""
        texts, alts = self._spell(ids, others)
        full = self.decode(ids)
        if "".join(texts) != full:
            texts = self._exact(ids, full)
        return texts, alts

    def _spell(self, ids: list[int], others: list[list[int]]) -> tuple[list[str], list[list[str]]]:
        texts: list[str] = []
        alts: list[list[str]] = []
        start = 0  # the decoding window's first token: the last that added text
        done = 0  # the tokens before ``done`` have their texts; those from it to ``i`` are held back
        for i, token in enumerate(ids):
            head = ids[start:i]
            before = self.decode(ids[start:done])
            # a token ending inside a character is held back: its text waits for the token that finishes the
            # character (at most ``_BYTES`` tokens, never past the last)
            hold = i - done + 1 < _BYTES
            text, held = self._added(head, before, token, hold and i < len(ids) - 1)
            texts.append(text)
            alts.append([self._added(head, before, t, hold)[0] for t in others[i]])
            if not held:
                done = i + 1
                if text:
                    start = i
            if done - start > _WINDOW:  # a long run of tokens without text
                start = done - _WINDOW
        return texts, alts

    def _added(self, head: list[int], before: str, token: int, hold: bool) -> tuple[str, bool]:
        """The text ``token`` adds after ``head`` (which decodes to ``before``, then tokens held back), and
        whether it is held back (``hold``, and it ends inside a character: its text is then empty)."""
        new = self.decode([*head, token])
        text = new[len(before) :] if new.startswith(before) else new[_common(new, before) :]
        if hold and text.endswith(UNFINISHED):
            return "", True
        return text, False

    def _exact(self, ids: list[int], full: str) -> list[str]:
        """Where decoding a token changes the text before it (a decoder's clean-up of spaces, invalid bytes):
        each token's text is what it makes final of ``full``, the decoding of them all, decoding each token
        after all those before it."""
        texts, at = [], 0
        for i in range(len(ids)):
            upto = full if i == len(ids) - 1 else self.decode(ids[: i + 1])
            final = max(at, _common(upto, full))
            texts.append(full[at:final])
            at = final
        return texts


def _common(a: str, b: str) -> int:
    """The length of the beginning ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
