"""Stop strings, looked for incrementally in a request's output text (``Request.stop``).

Each check decodes only a short window of the latest tokens, keeps the settled text, and looks for the stop
strings only in the tail where a new match can be (the last ``len(longest stop) - 1`` characters of what was
there before, and the new text). A hit is confirmed against the decoding of the whole output, so where the
output stops and the text it keeps are what decoding the whole output at every token gave. Imports nothing
of the engine, so the request can name its type; :class:`~.output.OutputProcessor` calls it with its
tokenizer's decode.

The settled text equals the whole decoding only where the decoding is the tokens' pieces joined: each piece
depends on its token alone, except the first token's (a SentencePiece-style decoder drops its leading space)
and bytes that join into a character across tokens. A window that starts a token back decodes that first
token the same way in both of its decodings, so the difference between them is the new text; a character cut
in its bytes waits for the rest. A decoding that rewrites the joined text is not that: transformers' clean-up
(``clean_up_tokenization_spaces``, which it applies to WordPiece and Unigram tokenizers) turns ``dog ' f``
into ``dog'f``, so the stop string ``g'f`` is in the whole decoding and in no window's, and a tail search
misses it. :func:`window_safe` decides once, from the tokenizer, whether its decoding is known to be pieces
joined (a tokenizers-library decoder of the kinds listed in ``PIECE_DECODERS``, decode not overridden, no
clean-up); for any other tokenizer each check decodes the whole output (``StopScan.whole``), slower but
exact.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

# tokenizers-library decoders whose text is each token's piece joined (see window_safe): Replace, Strip and
# WordPiece (its cleanup included) change each piece by itself, and Metaspace (and Strip after Fuse) the first
# only; ByteFallback and ByteLevel join bytes into characters; Fuse joins; BPEDecoder's end-of-word suffix
# becomes a space once a token follows, which only adds to the text.
PIECE_DECODERS = frozenset(
    {
        "ByteLevel",
        "Metaspace",
        "ByteFallback",
        "Fuse",
        "Replace",
        "Strip",
        "WordPiece",
        "BPEDecoder",
        "Sequence",
    }
)


def _decoder_types(spec: dict) -> set[str]:
    types = {str(spec.get("type"))}
    for inner in spec.get("decoders") or ():
        types |= _decoder_types(inner)
    return types


def window_safe(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is known to be its tokens' pieces joined, so a window of the latest tokens
    decodes the new text exactly (the module docstring): a transformers tokenizer over the tokenizers library
    whose ``decode`` is transformers' own, with a decoder of ``PIECE_DECODERS`` (or none: pieces joined by
    spaces) and no clean-up of the joined text. False for anything else (the whole output is decoded)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: its decoding is its own
        return False
    for name in ("decode", "_decode"):  # a model's tokenizer class may decode its own way (Whisper)
        method = getattr(type(tokenizer), name, None)
        if not getattr(method, "__module__", "").startswith("transformers.tokenization_utils"):
            return False
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for BPE models, unless told not to (where it has that flag)
        flag = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        if type(backend.model).__name__ != "BPE" or getattr(tokenizer, flag, True):
            return False
    if backend.decoder is None:
        return True
    try:
        spec = json.loads(backend.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    return _decoder_types(spec) <= PIECE_DECODERS


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
    whole: bool = False  # the tokenizer is not window_safe: each check decodes the whole output

    def found(
        self, token_ids: list[int], base: int, stops: list[str], decode: Callable[[list[int]], str]
    ) -> bool:
        """Whether the output ``token_ids[base:]`` (a request's tokens after its prompt) contains one of
        ``stops``; the first one's position in the text is kept in ``match``."""
        if self.match is not None:  # found already (a resumed request is checked twice)
            return True
        end = len(token_ids)
        if self.whole:
            return self._confirm(decode(token_ids[base:end]), stops)
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
        return self._confirm(decode(token_ids[base:end]), stops)

    def _confirm(self, text: str, stops: list[str]) -> bool:
        """Whether the whole output's ``text`` contains one of ``stops`` (the first one's position: ``match``)."""
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return False
        self.match = min(hits)
        return True
