"""A chat template's render, checked: a message the template leaves out is said, never lost.

Templates drop what they do not know without a word: Phi-3's first template wrote no system turn (so
``--system`` changed nothing), Qwen2.5's skips a role it does not name, a later Phi-3 template skips tool
messages. After each render every message but the assistant's must show its text in the rendered prompt
(stripped: templates often ``| trim``; or as JSON text: some ``| tojson`` a tool's result); an assistant's
earlier turn is left to the template (Qwen3 strips its thinking). At setup one probe conversation (the
``--system`` message and a user message) is rendered once, so that a template that rejects or drops what
every row would give stops the job before work, with the template's own words. This module knows nothing of
rows or files.
"""

from __future__ import annotations

import json
from typing import Any

from batchjob.errors import ConfigError

PROBE = "Paris is the capital of France."  # the probe conversation's user message: any plain text would do


def render(
    tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, kwargs: dict[str, Any]
) -> str:
    """``messages`` as the chat template renders them (text; ``generation_prompt``: the assistant's header
    after them); raises what the template raises."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )


def _shown(content: str, text: str) -> bool:
    stripped = content.strip()
    return stripped in text or json.dumps(stripped, ensure_ascii=False)[1:-1] in text


def left_out(messages: list[dict[str, str]], text: str) -> int | None:
    """The index of the first message, an assistant's aside, whose text the rendered ``text`` lacks."""
    return next(
        (i for i, m in enumerate(messages) if m["role"] != "assistant" and not _shown(m["content"], text)),
        None,
    )


def _template_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    return f"the chat template of {name}"


def check_chat_render(
    tokenizer: Any, system: str | None, wraps: bool, generation_prompt: bool, kwargs: dict[str, Any]
) -> None:
    """Refuse, before any work, a chat template that rejects or drops what every row would give it: the
    ``--system`` message, and (``wraps``: plain prompts wrapped as a user message) one user message after it.
    Raises ``ConfigError`` with the template's own message."""
    if system is None and not wraps:
        return
    messages = [{"role": "user", "content": PROBE}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    template = _template_name(tokenizer)
    given = "--system and a user message" if system is not None else "a user message (each row's prompt)"
    way_out = (
        "leave out --system, or put its text into the prompt with --template (e.g. --template "
        "'<instruction>\\n\\n{prompt}')"
        if system is not None
        else "give --no-chat to send each prompt as it is"
    )
    try:
        text = render(tokenizer, messages, generation_prompt, kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the template raises, it would raise for every row
        raise ConfigError(
            f"{template} rejects a conversation of {given} ({type(e).__name__}: {e}), so every row would be "
            f"an error: {way_out}"
        ) from None
    missing = left_out(messages, text)
    if missing is not None:
        what = "the --system message" if messages[missing]["role"] == "system" else "the user message"
        raise ConfigError(
            f"{template} leaves {what} out of the prompt it renders (its text is not in {text[:300]!r}), so it "
            f"would change nothing: {way_out}"
        )
