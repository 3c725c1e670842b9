"""From a row to prompt token ids, or to the reason the row has no usable prompt.

Exactly one source of text per job: ``--prompt-column`` (the column's text), ``--messages-column`` (a list of
``{"role", "content"}`` messages, or its JSON text) or ``--template`` (text with ``{column}`` fields).
Without any, a column named ``prompt`` or ``text`` is the prompt (or ``messages`` the messages). ``--chat``
(default: on when the tokenizer has a chat template and the task generates) wraps a plain prompt as a user
message, after the ``--system`` message if one is given. A chat render ends with the generation prompt only
where a continuation follows (``PromptPlan.generation_prompt``). A row's problem is returned as an error
string, never raised: a bad row must not stop the job.

Templates (``templates.py``) are parsed when the spec is checked, and their columns' types checked here against
the input's schema before any work.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError, InputError
from batchjob.io.jsontext import RefusedText, loads_text
from batchjob.job.chat_messages import chat_messages, ends_answered
from batchjob.job.rendered import check_chat_render, dropped, left_out, render
from batchjob.job.requests import COMPLETIONS_NO_KWARGS, COMPLETIONS_NO_SYSTEM
from batchjob.job.spec import JobSpec
from batchjob.job.templates import (
    TEMPLATE_RULES,
    TemplateField,
    parse_template,
    render_template,
    renders_by_type,
    template_fields,
)
from batchjob.sampling import greedy_samples


@dataclass(frozen=True)
class PromptPlan:
    """How prompts are built, resolved against the input's columns before any work."""

    kind: str  # "column" | "messages" | "template" | "openai"
    column: str | None  # the text or messages column (kind "column" / "messages")
    template: str | None
    template_fields: tuple[str, ...]
    system: str | None
    chat: bool
    # a template's columns and their pyarrow types, where the input's schema is known: Arrow gives a map's
    # value as a list of (key, value) pairs, and only the type tells it from a list of pairs (and a float32's
    # widened float64 from its own value)
    types: tuple[tuple[str, Any], ...] = ()
    # whether a chat render ends with the template's generation prompt (the assistant's header): only where a
    # continuation follows it (generate, score with --score-column); a classifier, an embedding or a whole
    # text's log-likelihood reads the conversation as it is, as apply_chat_template(conv) renders it (a
    # reward model's usage; a header after it would be read, or scored, as part of the text)
    generation_prompt: bool = True

    @property
    def columns(self) -> list[str]:
        return [self.column] if self.column else list(self.template_fields)

    def for_tokenizer(self, spec: JobSpec, has_chat_template: bool) -> PromptPlan:
        """This plan for the model's tokenizer, with or without a chat template (what the plan assumed
        before the tokenizer was known); raises for what a tokenizer without one cannot do."""
        chat = resolve_chat(spec, has_chat_template)
        follows = spec.engine.task == "generate" or spec.score_column is not None  # a continuation
        plan = replace(self, generation_prompt=follows)
        if plan.kind == "openai":  # each request's messages go through the template when there is one
            if spec.template_kwargs and not has_chat_template:  # they were taken without a word
                raise ConfigError(
                    "--chat-template-kwargs go to the chat template, and this model's tokenizer has none, so "
                    "no request goes through one (a chat request is its row's error): leave them out"
                )
            return replace(plan, chat=has_chat_template)
        if plan.kind == "messages":
            if spec.chat is False:  # it was let go on a text model, and made every row an error on a VLM's
                named = "--messages-column" if spec.messages_column else "the input's messages column"
                raise ConfigError(
                    f"--no-chat with {named} {self.column!r}: a column of chat messages is always rendered "
                    "by the model's chat template; leave --no-chat out (for prompts as they are, give "
                    "--prompt-column or --template)"
                )
            if not has_chat_template:
                raise ConfigError(
                    f"messages column {self.column!r} needs a tokenizer with a chat template; this one has none"
                )
            return replace(plan, chat=True)
        if spec.template_kwargs and not chat:  # they were taken without a word
            raise ConfigError(
                "--chat-template-kwargs go to the chat template, and this job's prompts do not go through it "
                "(--no-chat, a task's plain text, or a tokenizer without one): leave them out, or give --chat"
            )
        return replace(plan, chat=chat)


def check_render(spec: JobSpec, plan: PromptPlan, tokenizer: Any) -> None:
    """Before any work, render one probe conversation (``rendered.check_chat_render``): a template that
    rejects or drops the --system message, or a plain prompt's user message, would do so for every row. An
    image job's prompts are its processor's render, probed through it (``rows/images.check_job_render``,
    which calls this for the other jobs). ``plan``: for the tokenizer."""
    if plan.chat and spec.image_column is None:
        wraps = plan.kind in ("column", "template")
        check_chat_render(tokenizer, plan.system, wraps, plan.generation_prompt, spec.template_kwargs)


def resolve_chat(spec: JobSpec, has_chat_template: bool) -> bool:
    """Whether plain prompts are wrapped in the chat template: ``--chat/--no-chat``, else if there is one
    (generation; the other tasks take a text as it is unless --chat asks)."""
    if spec.chat and not has_chat_template:
        raise ConfigError("--chat asked for, but the model's tokenizer has no chat template; use --no-chat")
    if spec.chat is None:
        return has_chat_template and spec.engine.task == "generate"
    return spec.chat


def plan_prompts(
    spec: JobSpec, columns: list[str], has_chat_template: bool, schema: Any = None
) -> PromptPlan:
    """Check the spec's prompt options against the input's ``columns``; raise naming what is wrong.
    ``schema``: the input's ``pyarrow.Schema`` where known; a template keeps its columns' types from it."""
    available = ", ".join(columns) or "(none)"

    def need(col: str, option: str) -> None:
        if col not in columns:
            raise InputError(f"{option} {col!r}: the input has no such column (columns: {available})")

    if spec.format == "openai":
        for col in ("custom_id", "url", "body"):
            need(col, "--format openai needs the request field")
        plan = PromptPlan("openai", "body", None, (), spec.system, has_chat_template)
        return plan.for_tokenizer(spec, has_chat_template)
    if spec.id_column is not None:
        need(spec.id_column, "--id-column")
    if spec.params_column is not None:
        need(spec.params_column, "--params-column")
    if spec.score_column is not None:
        need(spec.score_column, "--score-column")
    if spec.image_column is not None:
        need(spec.image_column, "--image-column")
    if spec.adapter_column is not None:  # else every row would run on the base model, without a word
        need(spec.adapter_column, "--adapter-column")
    resolve_chat(spec, has_chat_template)
    if spec.template is not None:
        fields = template_fields(spec.template)
        if not fields:
            _check_fieldless(spec, spec.template, available)
        for f in fields:
            need(f, "--template field")
        types = tuple((f, schema.field(f).type) for f in fields) if schema is not None else ()
        plan = PromptPlan("template", None, spec.template, fields, spec.system, False, types)
    elif spec.messages_column is not None or (
        spec.prompt_column is None
        and "messages" in columns
        and "prompt" not in columns
        and "text" not in columns
    ):
        col = spec.messages_column or "messages"
        need(col, "--messages-column")
        plan = PromptPlan("messages", col, None, (), spec.system, True)
    elif spec.prompt_column is not None:
        need(spec.prompt_column, "--prompt-column")
        plan = PromptPlan("column", spec.prompt_column, None, (), spec.system, False)
    else:
        col = next((c for c in ("prompt", "text") if c in columns), None)
        if col is None:
            raise InputError(
                "no prompt column: the input has no 'prompt' or 'text' column; choose one with "
                f"--prompt-column, --messages-column or --template (columns: {available})"
            )
        plan = PromptPlan("column", col, None, (), spec.system, False)
    _check_pair(spec, plan, columns)
    return plan.for_tokenizer(spec, has_chat_template)


# The second text of a pair classifier's input (NLI, paraphrase, a reranker), under the name transformers'
# text-classification pipeline reads it ({"text": ..., "text_pair": ...}): it goes in a segment of its own.
PAIR_COLUMN = "text_pair"


def _check_pair(spec: JobSpec, plan: PromptPlan, columns: list[str]) -> None:
    """Refuse a classify job whose input has a ``text_pair`` column its prompts leave out: each row would be
    classified as if it had no second text, without a word (rows differing only there got one score)."""
    if spec.engine.task != "classify" or PAIR_COLUMN not in columns or PAIR_COLUMN in plan.columns:
        return
    read = f"column {plan.column!r}" if plan.column else f"--template {plan.template!r}"
    raise ConfigError(
        f"the input has a {PAIR_COLUMN!r} column, a pair classifier's second text (transformers' "
        f"text-classification pipeline reads it as a second segment); --task classify reads one text a row "
        f"({read}) and has no second segment, so it would classify every row as if it had none. To classify "
        f"the text alone, drop or rename the {PAIR_COLUMN!r} column"
    )


def _check_fieldless(spec: JobSpec, template: str, columns: str) -> None:
    """Refuse a template without a field where every row would get one prompt and one answer: no text at
    all; a file's path (a template is its text); or greedy decoding (the ``greedy_samples`` reasoning) with
    nothing else that differs by row (an image, an adapter, a scored column, a row's own parameters).
    Sampled, one prompt makes many answers (synthetic data): that is a use. ``columns``: for the message."""
    if not template.strip():  # every row's prompt would be empty
        raise ConfigError(f"--template {template!r} has no fields and no text; {TEMPLATE_RULES}")
    name = f"--template {template!r} has no field"
    try:
        is_file = "\n" not in template and len(template) < 4096 and Path(template).expanduser().is_file()
    except OSError:  # not a path this system takes: not a file
        is_file = False
    if is_file:
        raise ConfigError(
            f"{name}: it is a file's path, and a template is text, not a file. Pass the file's text, as "
            f'--template "$(cat {shlex.quote(template)})" in a shell, or in a job file as template = """..."""'
            " (a multi-line string), with column names in braces, like {review}"
        )
    by_row = (spec.image_column, spec.adapter_column, spec.score_column)
    if spec.effective_temperature > 0 or spec.per_row_params or any(c is not None for c in by_row):
        return
    generate = spec.engine.task == "generate"
    same = "answer, as decoding is greedy (temperature 0)" if generate else "result"
    sample = "; or give --temperature above 0 for samples of one prompt" if generate else ""
    raise ConfigError(
        f"{name}: every row's prompt would be this same text, with one identical {same}. Name the row's "
        f"columns in braces, like {{review}} (the input's columns: {columns}){sample}"
    )


def check_column_types(spec: JobSpec, plan: PromptPlan, schema: Any) -> None:
    """Refuse, before any work, what the input's column types (``schema``, a ``pyarrow.Schema``) already
    say every row would fail: a template index into text or a number, a struct key that is not one of the
    struct's fields, a prompt column that is not text, a params column that can't hold JSON objects (or a
    struct with a field that is no sampling parameter). A type that allows good rows (JSON text, a map, a
    JSONL column of mixed values) is left to the rows: one bad row stays that row's error."""
    names = set(schema.names)
    for part in parse_template(plan.template) if plan.kind == "template" and plan.template else ():
        if not isinstance(part, TemplateField) or not part.path or part.column not in names:
            continue
        _check_template_field(part, schema.field(part.column))
    if plan.kind == "column" and plan.column is not None and plan.column in names:
        _check_prompt_column(plan.column, schema.field(plan.column).type)
    if spec.params_column is not None and spec.params_column in names:
        _check_params_column(spec.params_column, schema.field(spec.params_column).type, spec)


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_scalar(t: Any) -> bool:
    """A number, a boolean, a date or time: a value of its own, no parts."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    kinds = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_decimal)
    return any(check(t) for check in kinds) or pa.types.is_temporal(t)


def _check_template_field(part: TemplateField, field: Any) -> None:
    """A template field's index path (``{col[key][0]}``) against its column's type (``field``, a
    ``pyarrow.Field``), as deep as the type tells."""
    import pyarrow as pa

    from batchjob.io.schema import is_text_only

    t, where = field.type, part.column
    for depth, key in enumerate(part.path):
        if pa.types.is_struct(t):
            keys = [t.field(i).name for i in range(t.num_fields)]
            if key not in keys:
                raise ConfigError(
                    f"--template field {part.text}: {where!r} is a struct with the fields "
                    f"{', '.join(keys)}; no row has [{key}]"
                )
            t = t.field(key).type
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            if not key.isdigit():
                raise ConfigError(
                    f"--template field {part.text}: {where!r} is a list; index it with a number, not [{key}]"
                )
            t = t.value_type
        elif not (_is_scalar(t) or (_is_text(t) and (depth > 0 or is_text_only(field)))):
            break  # what its rows hold is not known before them (a map, or JSON text of nested values)
        else:
            kind = "text" if _is_text(t) else str(t)
            raise ConfigError(
                f"--template field {part.text}: {where!r} is {kind} in the input, so no row has [{key}]; "
                f"index only struct, map or list columns (or use {{{part.column}}} as it is)"
            )
        where += f"[{key}]"


def _check_prompt_column(column: str, t: Any) -> None:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    kinds = (
        pa.types.is_struct,
        pa.types.is_list,
        pa.types.is_large_list,
        pa.types.is_fixed_size_list,
        pa.types.is_map,
    )
    binary = any(
        kind(t)
        for kind in (
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_fixed_size_binary,
            pa.types.is_binary_view,
        )
    )
    if _is_scalar(t) or binary or any(kind(t) for kind in kinds):
        bytes_note = " (bytes; every row would be refused as not text)" if binary else ""
        raise ConfigError(
            f"prompt column {column!r} is {t} in the input{bytes_note}, not text: choose a text column with "
            "--prompt-column, or build the prompt with --template"
        )


def _check_params_column(column: str, t: Any, spec: JobSpec) -> None:
    import pyarrow as pa

    from batchjob.job.requests import PARAM_NAMES

    if pa.types.is_struct(t):
        keys = [t.field(i).name for i in range(t.num_fields)]
        unknown = [k for k in keys if k not in PARAM_NAMES]
        if unknown:
            raise ConfigError(
                f"--params-column {column!r}: its struct has fields that are no sampling "
                f"parameter: {', '.join(unknown)} (known: {', '.join(sorted(PARAM_NAMES))})"
            )
        greedy = greedy_samples(spec.n, spec.effective_temperature)
        if greedy and "temperature" not in keys and "n" not in keys:  # no row can make samples of it
            raise ConfigError(
                f"--n {spec.n}, --temperature {spec.effective_temperature:g}: {greedy} (--params-column "
                f"{column!r} is a struct with neither a temperature nor an n field, so no row gives its own)"
            )
    elif _is_scalar(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        # a map's values share one type: max_new_tokens would be a float beside temperature
        kind = "a map, whose values share one type," if pa.types.is_map(t) else t
        raise ConfigError(
            f"--params-column {column!r} is {kind} in the input: it must hold a JSON object of "
            'sampling parameters per row, as text or a struct, e.g. {"temperature": 0.7}'
        )


class PromptBuilder:
    """Builds prompt token ids for rows; the tokenizer is the engine's."""

    def __init__(
        self,
        plan: PromptPlan,
        tokenizer: Any,
        max_model_len: int | None,
        template_kwargs: dict[str, Any] | None = None,
        truncate_to: int | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> None:
        """``max_model_len``: a prompt of this many tokens or more is an error (None: the engine checks its
        length, as prefill-only tasks do); ``truncate_to``: cut a text longer than this by the tokenizer (the
        tasks' --truncate, as ``Engine.tokenize`` cuts); ``tokenize``: makes a plain text's ids instead of
        the tokenizer (embed: the engine's, as the model's sentence-transformers files say)."""
        self.tokenize = tokenize
        self.plan = plan
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.truncate_to = truncate_to
        self.template_kwargs = (
            template_kwargs or {}
        )  # --chat-template-kwargs, e.g. {"enable_thinking": false}
        self._template = parse_template(plan.template) if plan.template is not None else ()
        self._types = {c: t for c, t in plan.types if renders_by_type(t)}  # a map, a float32: by their type

    def text(self, values: dict[str, Any]) -> tuple[str | None, str | None]:
        """(prompt text, None) or (None, why this row has no usable prompt)."""
        plan = self.plan
        if plan.kind == "template":
            text, error = render_template(self._template, values, self._types)
            return (None, error) if text is None else self._wrap(text)
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
        return self._wrap(value)

    def _wrap(self, text: str) -> tuple[str | None, str | None]:
        if not self.plan.chat:
            return text if self.plan.system is None else f"{self.plan.system}\n\n{text}", None
        return self._chat([{"role": "user", "content": text}], None)

    def _messages(self, value: Any) -> tuple[str | None, str | None]:
        col = self.plan.column
        if isinstance(value, str):
            try:
                value = loads_text(value)
            except RefusedText as e:  # a key given twice, half a UTF-16 pair: named
                return None, f"column {col!r}: {e}"
            except (ValueError, RecursionError):
                return (
                    None,
                    f"column {col!r} is not a list of messages (text that is not JSON, or nested too deeply)",
                )
        if not isinstance(value, list) or not value:
            return None, f"column {col!r} is not a non-empty list of {{role, content}} messages"
        # as an OpenAI request's messages: developer is system, an unknown role or another key is refused
        messages, error = chat_messages(value, f"column {col!r}: messages")
        if messages is None:
            return None, error
        answered = ends_answered(messages, str(col)) if self.plan.generation_prompt else None
        if answered is not None:  # (an SFT set's reference answer)
            return None, answered
        text, error = self._chat(messages, "messages")
        return text, None if error is None else f"column {col!r}: {error}"

    def _chat(self, messages: list[dict[str, str]], where: str | None) -> tuple[str | None, str | None]:
        """The conversation rendered, with --system first unless it starts with its own system message, or
        the error: the template rejects it, or leaves a message out (``where``: how the error names one)."""
        given = self.plan.system is not None and messages[0]["role"] != "system"
        if given:
            messages = [{"role": "system", "content": self.plan.system or ""}, *messages]
        try:
            text = render(self.tokenizer, messages, self.plan.generation_prompt, self.template_kwargs)
        except Exception as e:  # the template itself may reject the conversation (e.g. role order)
            if where is None:  # a plain prompt's: the row's request names the exception (rows/prompt.py)
                raise
            return None, f"chat template rejects these messages: {e}"
        missing = left_out(messages, text)
        return (text, None) if missing is None else (None, dropped(messages, missing, given, where))

    def build(self, values: dict[str, Any]) -> tuple[list[int] | None, str | None]:
        """(prompt token ids, None) or (None, error)."""
        text, error = self.text(values)
        if text is None:
            return None, error
        return self._tokens(text, chat=self.plan.chat)

    def build_request(self, request: dict[str, Any]) -> tuple[list[int] | None, str | None]:
        """An OpenAI request's prompt (``requests.parse_request``): chat messages through the chat template,
        a completions prompt as it is."""
        if "prompt" in request:
            if self.plan.system is not None:  # it was dropped from such a request without a word
                return None, COMPLETIONS_NO_SYSTEM
            if self.template_kwargs:  # they were dropped from such a request without a word
                return None, COMPLETIONS_NO_KWARGS
            return self._tokens(request["prompt"], chat=False)
        if not self.plan.chat:
            return None, "a chat request needs a model whose tokenizer has a chat template; this one has none"
        text, error = self._chat(request["messages"], "body.messages")
        return (None, error) if text is None else self._tokens(text, chat=True)

    def _tokens(self, text: str, chat: bool) -> tuple[list[int] | None, str | None]:
        # A chat template writes its own special tokens; a plain prompt gets the tokenizer's (e.g. BOS).
        cut = self.truncate_to is not None
        if self.tokenize is not None and not chat:
            ids = self.tokenize(text)
        else:
            ids = self.tokenizer(
                text,
                add_special_tokens=not chat,
                truncation=cut,
                max_length=self.truncate_to if cut else None,
            )["input_ids"]
        if not ids:
            return None, "the prompt has no tokens"
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            return (
                None,
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} tokens "
                "(the model's, or --max-model-len)",
            )
        return list(ids), None
