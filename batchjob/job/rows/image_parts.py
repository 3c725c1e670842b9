"""OpenAI content parts with images (``--format openai`` or ``--messages-column`` on a vision-language
model): a message's ``{"type": "image_url", "image_url": {"url": ...}}`` parts as the processor's
``{"type": "image"}`` parts, in place, and the images they name, in order. A url is a ``data:`` URL (base64), a ``file://`` URL or a local
path (relative to the input file's folder); ``http(s)://`` is never fetched (that row's error, when read).
"""

from __future__ import annotations

import json
from typing import Any

from batchjob.io.jsontext import RefusedText, loads_text
from batchjob.job.chat_messages import chat_messages
from batchjob.job.images import ImageRef, data_url


def _url_ref(value: Any, k: int) -> tuple[ImageRef | None, str | None]:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        return None, "image_url.url must be a non-empty string"
    if not url.startswith("data:"):
        return ImageRef(k, None, url), None
    data, error = data_url(url)
    return (None, error) if data is None else (ImageRef(k, data, None), None)


def image_parts(messages: Any, where: str) -> tuple[list[Any] | None, list[ImageRef], str | None]:
    """Each message's content with its image parts as ``{"type": "image"}`` (content that is not a list as
    it is), and the images in order; or the error naming the part (``where``: its field's prefix)."""
    if not isinstance(messages, list):
        return messages, [], None  # the text path names what is wrong with it
    out: list[Any] = []
    refs: list[ImageRef] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(content)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                ref, error = _url_ref(part.get("image_url"), len(refs))
                if ref is None:
                    return None, [], f"{where}messages[{i}].content[{j}]: {error}"
                refs.append(ref)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append(parts)
    return out, refs, None


def text_only(messages: Any) -> Any:
    """The messages without their image parts: what the text path checks (roles, text parts)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            kept = [p for p in content if not (isinstance(p, dict) and p.get("type") == "image_url")]
            m = {**m, "content": kept}
        out.append(m)
    return out


def with_images(parsed: list[dict[str, str]], contents: list[Any]) -> list[dict[str, Any]]:
    """The checked messages (role, joined text) with each list content's parts back, images in place."""
    out: list[dict[str, Any]] = []
    for m, content in zip(parsed, contents, strict=True):
        if isinstance(content, list):
            parts = [p if p.get("type") == "image" else {"type": "text", "text": p["text"]} for p in content]
            out.append({"role": m["role"], "content": parts})
        else:
            out.append({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]})
    return out


def request_refs(values: dict[str, Any]) -> list[ImageRef]:
    """The images an OpenAI request line's messages name (none when it has none, or is no chat request)."""
    body = values.get("body")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return []
    if not isinstance(body, dict):
        return []
    _, found, _ = image_parts(body.get("messages"), "")
    return found


def pictured(contents: list[Any] | None) -> frozenset[int]:
    """The indexes of the messages that hold an image (``image_parts``' contents): a message of images alone
    has no text, and is no empty one."""
    return frozenset(
        i for i, c in enumerate(contents or ()) if isinstance(c, list) and {"type": "image"} in c
    )


def parse_messages(value: Any, column: str) -> tuple[list[dict[str, Any]] | None, list[ImageRef], str | None]:
    """A messages column's cell (a list, or its JSON text) whose contents are text or lists of OpenAI parts
    (text and image_url): the processor's messages (images in place) and the images, or the error. The
    messages follow a text model's rule (``chat_messages``: roles, developer as system, no empty message)."""
    if isinstance(value, str):
        try:
            value = loads_text(value)
        except RefusedText as e:  # a key given twice, half a UTF-16 pair: named, as on a text model
            return None, [], f"column {column!r}: {e}"
        except (ValueError, RecursionError):
            return None, [], f"column {column!r} is not a list of messages (text that is not JSON)"
    if not isinstance(value, list) or not value:
        return None, [], f"column {column!r} is not a non-empty list of {{role, content}} messages"
    contents, found, error = image_parts(value, f"column {column!r}: ")
    if contents is None:
        return None, [], error
    parsed, error = chat_messages(text_only(value), f"column {column!r}: messages", pictured(contents))
    if parsed is None:
        return None, [], error
    return with_images(parsed, contents), found, None


def messages_refs(column: str) -> Any:
    """The images a row's messages column names (none when the cell is not such a list)."""
    return lambda values: parse_messages(values.get(column), column)[1]


def refs_of(spec: Any, plan: Any) -> Any:
    """What names a job's images, for the files' record: OpenAI request lines, or a messages column."""
    return request_refs if spec.format == "openai" else messages_refs(plan.column)
