"""Reasoning models: the text between think tags is the ``reasoning`` column, the rest is the answer.

A model "thinks" inside a pair of tags (``<think>`` ... ``</think>``), found in its tokenizer (as added tokens,
or in its chat template) or given with ``--reasoning-tags OPEN,CLOSE``. A chat template may open the block
itself at the end of the prompt; otherwise the model opens it.

When the answer is constrained (``--choices``, ``--json-schema``, ``--regex``) or the thinking is bounded
(``--max-reasoning-tokens N``), a row runs in two requests: the **reasoning** one, from the prompt (with the
open tag) until the close tag or N tokens, then the **answer** one, from the prompt, the reasoning and the
close tag (added when the thinking ran long), under the constraint and ``--max-new-tokens``. The answer request
starts where the reasoning ended, so it reuses its KV through the prefix cache; both are seeded per row, so a
resumed job writes what an uninterrupted one would. Otherwise a row is one request whose text is split.
This module finds the tags and splits text; what a row of each sort asks the engine is ``rows/generate.py``'s
and ``rows/reasoning.py``'s (which also holds ``think_tags``, a job's tags from its options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchjob.errors import ConfigError

_TAIL = 48  # the prompt's last tokens read for its end: an empty block and the whitespace around it fit
_KNOWN = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<reasoning>", "</reasoning>"))


@dataclass(frozen=True)
class ReasoningTags:
    open: str
    close: str
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]

    def opened(self, prompt_ids: list[int], decode: Callable[[list[int]], str]) -> bool | None:
        """How the prompt's end leaves thinking: True when it ends inside an open block (the template opened
        it), False when it ends with an empty closed one (the template turned thinking off, as Qwen3's
        ``enable_thinking=False``), None otherwise. Only the end counts, read as text (``decode``): a tag is
        not always its own tokens there (``<think>`` then a newline may be ``<think`` and ``>\n``), and a
        tag in a message or an earlier turn's thinking is the conversation's text."""
        tail = decode(prompt_ids[-_TAIL:]).rstrip()
        if tail.endswith(self.open):
            return True
        if tail.endswith(self.close) and tail[: -len(self.close)].rstrip().endswith(self.open):
            return False
        return None

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """``(reasoning, answer)`` of a generated text; reasoning None when the model did not think."""
        if not inside:
            start = text.find(self.open)
            if start < 0 or text[:start].strip():
                return None, text
            text = text[start + len(self.open) :]
        end = text.find(self.close)
        if end < 0:
            return text.strip(), ""  # still thinking when it stopped
        return text[:end].strip(), text[end + len(self.close) :].lstrip()


def parse_tags(value: str) -> tuple[str, str]:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:  # one tag for both: where would it end?
        raise ConfigError(
            f"--reasoning-tags must be OPEN,CLOSE, two different tags such as '<think>,</think>', got {value!r}"
        )
    return parts[0], parts[1]


def find_tags(tokenizer: Any, given: tuple[str, str] | None) -> ReasoningTags | None:
    """The think tags of a tokenizer: given, else a known pair among its added tokens or in its template."""
    pairs = [given] if given is not None else list(_KNOWN)
    added = set(getattr(tokenizer, "get_added_vocab", dict)() or {})
    template = str(getattr(tokenizer, "chat_template", None) or "")
    for open_, close in pairs:
        if given is not None or {open_, close} <= added or (open_ in template and close in template):
            ids = [tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (open_, close)]
            if not all(ids):
                raise ConfigError(f"reasoning tag {open_ if not ids[0] else close!r} has no tokens")
            for tag, tag_ids in zip((open_, close), ids, strict=True):
                if tag not in tokenizer.decode(list(tag_ids), skip_special_tokens=True):
                    raise ConfigError(  # the split below is made in that text: it would not see the tag
                        f"reasoning tag {tag!r} is a special token of this tokenizer: the text batchjob writes "
                        "leaves special tokens out, so it could not tell the thinking from the answer (not "
                        "built yet; --reasoning-tags names other tags)"
                    )
            return ReasoningTags(open_, close, ids[0], ids[1])
    return None
