"""Chat messages as the chat template gets them: one rule for an OpenAI request's ``messages`` and a messages
column's, so that a conversation means the same whichever way it comes in.

A message is a role of the Chat Completions API (``developer`` is ``system``, as OpenAI reads it) and text
content (a string, or a list of text parts joined); anything else, an empty or blank text, or a key besides
role and content is the row's error naming the message, never dropped or passed on for the template to guess
at.
This module knows nothing of tokenizers or files.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")  # the Chat Completions API's message roles

ONLY_ROLE_AND_CONTENT = "a message has only role and content here: the prompt would be built without it"


def extra_key(message: dict[str, Any]) -> str | None:
    """A message's key besides role and content (name, tool_calls, ...), refused rather than dropped; a null
    one is absent (a Parquet struct gives every message every key)."""
    return next((k for k, v in message.items() if k not in ("role", "content") and v is not None), None)


def _message_text(content: Any, where: str) -> tuple[str | None, str | None]:
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return None, f"{where}.content[{j}]: only text parts are supported (got {kind!r})"
            parts.append(part["text"])
        return "\n".join(parts), None  # as vLLM joins them (with nothing: 'Paris isthe capital')
    return None, f"{where}.content must be text"


def chat_messages(
    messages: Any, where: str, pictured: frozenset[int] = frozenset()
) -> tuple[list[dict[str, str]] | None, str | None]:
    """``messages`` as role and text (``developer`` is ``system``), or the error naming the message as
    ``{where}[i]`` (``body.messages``, or a column's ``column 'm': messages``); a message with no text (and no
    image: ``pictured``, the indexes of a VLM's messages that hold images) is one, as an empty prompt column
    is (it was answered)."""
    if not isinstance(messages, list) or not messages:
        return None, f"{where} must be a non-empty list"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, f"{where}[{i}] must be an object with a role"
        if m["role"] not in ROLES:
            return None, f"{where}[{i}].role {m['role']!r} is not a role ({', '.join(ROLES)})"
        text, error = _message_text(m.get("content"), f"{where}[{i}]")
        if text is None:
            return None, error
        if not text.strip() and i not in pictured:  # as an empty prompt column: it would answer nothing said
            return None, f"{where}[{i}].content is empty (a {m['role']} message with no text)"
        other = extra_key(m)
        if other is not None:
            return None, f"{where}[{i}].{other} is not supported by batchjob ({ONLY_ROLE_AND_CONTENT})"
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": text})
    return out, None


def ends_answered(messages: list[dict[str, Any]], column: str) -> str | None:
    """The error of a messages column's conversation that ends with an assistant message, where a generation
    follows it (an SFT set's reference answer: the row would get a follow-up to it); None otherwise."""
    last = len(messages) - 1
    if messages[last]["role"] != "assistant":
        return None
    return (
        f"column {column!r}: the conversation ends with an assistant message (messages[{last}]): "
        "batchjob would answer after it; drop the final message (e.g. messages[:-1]) to regenerate it"
    )
