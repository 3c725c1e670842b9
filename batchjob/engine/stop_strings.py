"""Stop strings, looked for incrementally in a request's output text (``Request.stop``).

Each check decodes only a short window of the latest tokens, keeps the settled text, and looks for the stop
strings only in the tail where a new match can be (the last ``len(longest stop) - 1`` characters of what was
there before, and the new text). A hit is confirmed against the decoding of the whole output, so where the
output stops and the text it keeps are what decoding the whole output at every token gave. Imports nothing
of the engine, so the request can name its type; :class:`~.output.OutputProcessor` calls it with its
tokenizer's decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StopScan:
    """A request's output text, decoded a few tokens at a time, for its stop strings (offsets count output
    tokens)."""

    text: str = ""  # the settled text: of output[:read]
    prefix: int = 0  # each check decodes output[prefix:] again (a window that starts a token or so back)
    read: int = 0
    window_text: str = ""  # the decoding of output[prefix:read]
    longest: int = 1  # characters in the longest stop string
    match: int | None = field(default=None)  # where the first stop string starts in the output's text

    def found(
        self, token_ids: list[int], base: int, stops: list[str], decode: Callable[[list[int]], str]
    ) -> bool:
        """Whether the output ``token_ids[base:]`` (a request's tokens after its prompt) contains one of
        ``stops``; the first one's position in the text is kept in ``match``."""
        if self.match is not None:  # found already (a resumed request is checked twice)
            return True
        end = len(token_ids)
        window = decode(token_ids[base + self.prefix : end])
        if not window.startswith(self.window_text):  # the window decodes differently in context: rescan
            self.text, self.prefix, self.read, self.window_text = "", 0, 0, ""
            window = decode(token_ids[base:end])
        pending = window[len(self.window_text) :]
        start = max(0, len(self.text) - self.longest + 1)
        tail = self.text[start:] + pending
        if pending and not pending.endswith("\ufffd"):  # a character cut in its bytes waits for the rest
            self.text += pending
            self.prefix, self.read = self.read, end - base
            self.window_text = decode(token_ids[base + self.prefix : end])
        if not any(s in tail for s in stops):
            return False
        text = decode(token_ids[base:end])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return False
        self.match = min(hits)
        return True
