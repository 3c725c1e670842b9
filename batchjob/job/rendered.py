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
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]
) -> str:
    """``messages`` as the chat template renders them (text; ``generation_prompt``: the assistant's header
    after them); raises what the template raises."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )


def _shown(content: str, text: str) -> bool:
    stripped = content.strip()
    return stripped in text or json.dumps(stripped, ensure_ascii=False)[1:-1] in text


def _texts(content: Any) -> list[str]:
    """A message's texts: its content, or its text parts (a vision-language model's content parts, each
    rendered where it stands among the images)."""
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if p.get("type") == "text"]


def left_out(messages: list[dict[str, Any]], text: str) -> int | None:
    """The index of the first message, an assistant's aside, whose text (each text part's) the rendered
    ``text`` lacks."""
    return next(
        (
            i
            for i, m in enumerate(messages)
            if m["role"] != "assistant" and not all(_shown(t, text) for t in _texts(m["content"]))
        ),
        None,
    )


def dropped(messages: list[dict[str, Any]], missing: int, given: bool, where: str | None) -> str:
    """The row's error for ``messages[missing]``, left out of its render (``given``: the first message is
    --system, added to the row's own; ``where``: how the row's messages are named, None for a plain prompt)."""
    role = messages[missing]["role"]
    name = f"{where}[{missing - given}] (a {role} message)" if where else "the prompt"
    name = "the --system message" if given and missing == 0 else name
    return (
        f"the chat template leaves {name} out of the prompt it renders, so the model would never see it: "
        f"give the conversation without it, or a model whose template writes {role} messages"
    )


def _template_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    return f"the chat template of {name}"


def check_chat_render(
    tokenizer: Any,
    system: str | None,
    wraps: bool,
    generation_prompt: bool,
    kwargs: dict[str, Any],
    parts: bool = False,
) -> None:
    """Refuse, before any work, a chat template that rejects or drops what every row would give it: the
    ``--system`` message, and (``wraps``: plain prompts wrapped as a user message) one user message after it.
    ``tokenizer``: or a vision-language model's processor, whose messages hold content parts (``parts``).
    Raises ``ConfigError`` with the template's own message."""
    if system is None and not wraps:
        return
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROBE}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    if parts:  # as a processor's template reads every message (images.py: ImagePrompts._render)
        messages = [
            {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages
        ]
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
