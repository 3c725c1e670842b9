"""From a row to prompt token ids, or to the reason the row has no usable prompt.

Exactly one source of text per job: ``--prompt-column`` (the column's text), ``--messages-column`` (a list of
``{"role", "content"}`` messages, or its JSON text) or ``--template`` (a ``str.format`` string over columns).
Without any, a column named ``prompt`` or ``text`` is the prompt (or ``messages`` the messages). ``--chat``
(default: on when the tokenizer has a chat template) wraps a plain prompt as a user message, after the
``--system`` message if one is given. A row's problem is returned as an error string, never raised: a bad row
must not stop the job.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any

from batchjob.errors import ConfigError, InputError
from batchjob.job.spec import JobSpec


@dataclass(frozen=True)
class PromptPlan:
    """How prompts are built, resolved against the input's columns before any work."""

    kind: str  # "column" | "messages" | "template"
    column: str | None  # the text or messages column (kind "column" / "messages")
    template: str | None
    template_fields: tuple[str, ...]
    system: str | None
    chat: bool

    @property
    def columns(self) -> list[str]:
        return [self.column] if self.column else list(self.template_fields)


def template_fields(template: str) -> tuple[str, ...]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(f"--template {template!r} is not a valid format string: {e}") from e
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if base == "" or base.isdigit():
            raise ConfigError(f"--template {template!r}: use column names in braces, like {{review}}")
        names.append(base)
    return tuple(dict.fromkeys(names))


def resolve_chat(spec: JobSpec, has_chat_template: bool) -> bool:
    """Whether plain prompts are wrapped in the chat template: ``--chat/--no-chat``, else if there is one."""
    if spec.chat and not has_chat_template:
        raise ConfigError("--chat asked for, but the model's tokenizer has no chat template; use --no-chat")
    return has_chat_template if spec.chat is None else spec.chat


def plan_prompts(spec: JobSpec, columns: list[str], has_chat_template: bool) -> PromptPlan:
    """Check the spec's prompt options against the input's ``columns``; raise naming what is wrong."""
    available = ", ".join(columns) or "(none)"

    def need(col: str, option: str) -> None:
        if col not in columns:
            raise InputError(f"{option} {col!r}: the input has no such column (columns: {available})")

    if spec.id_column is not None:
        need(spec.id_column, "--id-column")
    chat = resolve_chat(spec, has_chat_template)
    if spec.template is not None:
        fields = template_fields(spec.template)
        for f in fields:
            need(f, "--template field")
        return PromptPlan("template", None, spec.template, fields, spec.system, chat)
    if spec.messages_column is not None or (
        spec.prompt_column is None
        and "messages" in columns
        and "prompt" not in columns
        and "text" not in columns
    ):
        col = spec.messages_column or "messages"
        need(col, "--messages-column")
        if not has_chat_template:
            raise ConfigError(
                f"messages column {col!r} needs a tokenizer with a chat template; this one has none"
            )
        return PromptPlan("messages", col, None, (), spec.system, True)
    if spec.prompt_column is not None:
        need(spec.prompt_column, "--prompt-column")
        return PromptPlan("column", spec.prompt_column, None, (), spec.system, chat)
    for col in ("prompt", "text"):
        if col in columns:
            return PromptPlan("column", col, None, (), spec.system, chat)
    raise InputError(
        f"no prompt column: the input has no 'prompt' or 'text' column; choose one with --prompt-column, "
        f"--messages-column or --template (columns: {available})"
    )


class PromptBuilder:
    """Builds prompt token ids for rows; the tokenizer is the engine's."""

    def __init__(self, plan: PromptPlan, tokenizer: Any, max_model_len: int) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def text(self, values: dict[str, Any]) -> tuple[str | None, str | None]:
        """(prompt text, None) or (None, why this row has no usable prompt)."""
        plan = self.plan
        if plan.kind == "template":
            for f in plan.template_fields:
                if f not in values:
                    return None, f"column {f!r} is missing in this row"
                if values[f] is None:
                    return None, f"column {f!r} is null"
            try:
                return self._wrap(plan.template.format_map(values)), None  # type: ignore[union-attr]
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
                return None, f"template does not apply to this row: {type(e).__name__}: {e}"
        col = plan.column
        assert col is not None
        if col not in values:
            return None, f"column {col!r} is missing in this row"
        value = values[col]
        if value is None:
            return None, f"column {col!r} is null"
        if plan.kind == "messages":
            return self._messages(value)
        if not isinstance(value, str):
            return None, f"column {col!r} is not text (got {type(value).__name__})"
        if not value.strip():
            return None, f"column {col!r} is empty"
        return self._wrap(value), None

    def _wrap(self, text: str) -> str:
        if not self.plan.chat:
            return text if self.plan.system is None else f"{self.plan.system}\n\n{text}"
        messages = [{"role": "user", "content": text}]
        if self.plan.system is not None:
            messages.insert(0, {"role": "system", "content": self.plan.system})
        return self._render(messages)

    def _messages(self, value: Any) -> tuple[str | None, str | None]:
        col = self.plan.column
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None, f"column {col!r} is not a list of messages (text that is not JSON)"
        ok = (
            isinstance(value, list)
            and value
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value
            )
        )
        if not ok:
            return None, f"column {col!r} is not a non-empty list of {{role, content}} messages"
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        if self.plan.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.plan.system})
        try:
            return self._render(messages), None
        except Exception as e:  # the template itself may reject the conversation (e.g. role order)
            return None, f"chat template rejects these messages: {e}"

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def build(self, values: dict[str, Any]) -> tuple[list[int] | None, str | None]:
        """(prompt token ids, None) or (None, error)."""
        text, error = self.text(values)
        if text is None:
            return None, error
        # A chat template writes its own special tokens; a plain prompt gets the tokenizer's (e.g. BOS).
        ids = self.tokenizer(text, add_special_tokens=not self.plan.chat)["input_ids"]
        if not ids:
            return None, "the prompt has no tokens"
        if len(ids) >= self.max_model_len:
            return (
                None,
                f"prompt of {len(ids)} tokens does not fit the model's context of {self.max_model_len}",
            )
        return list(ids), None
