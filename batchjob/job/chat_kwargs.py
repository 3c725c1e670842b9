"""``--chat-template-kwargs`` checked against the chat template that renders the job's prompts: a key the
template never reads changes no prompt, so it is refused before any work, naming the key and the variables
the template does read. A misspelt ``enable_thinkng``, or a job file's ``system`` that TOML put into the
``[chat_template_kwargs]`` table (every key after a table's header belongs to it), would else be dropped
without a word, and every row made without it.

The template is the one ``apply_chat_template`` renders (a dict of named templates: its ``default``, as
batchjob passes no tools): the tokenizer's, or the processor's for image rows. Its variables are its free
names as jinja2 finds them, parsed in the environment transformers renders it in.
"""

from __future__ import annotations

from typing import Any

from batchjob.errors import ConfigError
from batchjob.job.prompts import PromptPlan
from batchjob.job.spec import FIELD_NAMES, JobSpec

# What the template is given by batchjob or transformers, never by --chat-template-kwargs (not listed)
_GIVEN = {
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "documents",
    "raise_exception",
    "strftime_now",
    "namespace",
    "dict",
}


def check_job_kwargs(
    spec: JobSpec, plan: PromptPlan, tokenizer: Any, model_config: Any, resumed: bool
) -> None:
    """Refuse a key of the job's ``--chat-template-kwargs`` that the chat template rendering its prompts
    never reads: the processor's for a job of image rows (``takes_images``), else ``tokenizer``'s.
    ``resumed``: the output folder holds the job already (the message says how to go on)."""
    if not spec.template_kwargs:
        return
    from batchjob.job.rows.images import load_processor, takes_images  # (loads only for image rows)

    owner, what = tokenizer, "tokenizer"
    if takes_images(spec, plan, model_config):
        from batchjob.models import resolve_model  # (a hub id's folder, as the run loads it)

        owner, what = load_processor(resolve_model(spec.model), spec.trust_remote_code), "processor"
    check_kwargs(spec.template_kwargs, owner, what, resumed)


def template_text(owner: Any) -> str | None:
    """The chat template ``owner`` (a tokenizer or a processor) renders with: its own, or the ``default``
    of its named ones (None: none, and ``apply_chat_template`` refuses every row itself)."""
    template = getattr(owner, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def template_variables(template: str) -> frozenset[str]:
    """The free names the chat template ``template`` reads; raises ``ConfigError`` if it can't be parsed."""
    import jinja2
    import jinja2.meta
    from transformers.utils.chat_template_utils import (  # the environment (tags, extensions) it renders in
        _compile_jinja_template,
    )

    try:
        environment = _compile_jinja_template(template).environment
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateError as e:
        raise ConfigError(
            f"--chat-template-kwargs: the model's chat template can't be parsed ({type(e).__name__}: {e}), so "
            "what it reads is not known; every prompt through it would fail: fix the template, or leave "
            "the kwargs out"
        ) from e


def check_kwargs(kwargs: dict[str, Any], owner: Any, what: str = "tokenizer", resumed: bool = False) -> None:
    """Refuse the keys of ``kwargs`` that ``owner``'s chat template never reads (``what``: "tokenizer" or
    "processor", for the message)."""
    template = template_text(owner)
    if not kwargs or template is None:
        return
    read = template_variables(template)
    unread = [k for k in kwargs if k not in read]
    if not unread:
        return
    tokens = set(getattr(getattr(owner, "tokenizer", owner), "special_tokens_map", None) or {})
    offered = sorted(read - _GIVEN - tokens)
    keys = ", ".join(repr(k) for k in unread)
    one = len(unread) == 1
    reads = f"reads {', '.join(offered)}" if offered else "reads no variable of its own"
    message = (
        f"chat_template_kwargs: the {what}'s chat template never reads {keys}, so "
        f"{'it' if one else 'they'} would change no prompt (the template {reads}; a misspelt key?)"
    )
    fields = [k for k in unread if k.replace("-", "_") in FIELD_NAMES]
    if fields:
        named = ", ".join(repr(k) for k in fields)
        message += (
            f"; {named} {'is a job field' if len(fields) == 1 else 'are job fields'}: in a job file, TOML puts "
            "every key after the [chat_template_kwargs] header into that table, so move "
            f"{'it' if len(fields) == 1 else 'them'} above the header"
        )
    if resumed:
        message += (
            f". This --output folder's job was started with {'it' if one else 'them'} by an earlier batchjob, "
            f"which ignored {'it' if one else 'them'} (its rows were made as if {'it was' if one else 'they were'}"
            " not given); with other kwargs it is a different job: give a new --output"
        )
    raise ConfigError(message)
