"""An image row's prompt (``--image-column``): the row's images (``job/images.py``: read, decoded) then its
text (``--prompt-column`` or ``--template``) as one user message, rendered by the model's processor's chat
template (``[{"type": "image"}, ..., {"type": "text", "text": prompt}]``); then the processor makes the token
ids and the image outputs the engine takes (``pixel_values`` and whatever else the family's processor
gives). With ``--no-chat`` the text is the prompt as it is: it holds the model's image token (``<image>``)
once per image, where each image goes.

Messages (``--format openai`` request lines, ``--messages-column``) on a vision-language model take OpenAI's
image parts (``image_parts.py``), rendered the same way. A row with no images (null, an empty list) is a
text-only row through the same processor. Everything that
goes wrong with a row is its error, naming the row and the image; a file that changed since the job recorded
it stops the job (``ImageChangedError``).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchjob.errors import ConfigError
from batchjob.job import images as img
from batchjob.job.chat_messages import ends_answered
from batchjob.job.checks import flags
from batchjob.job.prompts import PromptBuilder, check_render
from batchjob.job.rendered import check_chat_render, dropped, left_out
from batchjob.job.requests import params_from_column
from batchjob.job.rows.image_parts import image_parts, parse_messages, pictured, text_only, with_images

if TYPE_CHECKING:
    from batchjob.io.readers import Row
    from batchjob.io.sources import Source
    from batchjob.job.prompts import PromptPlan
    from batchjob.job.spec import JobSpec
    from batchjob.sampling import SamplingParams

NOT_IMAGE_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def check_plan(spec: JobSpec, plan: PromptPlan) -> None:
    """Before any work: an image column takes the prompt from a text column or a template."""
    if spec.image_column is not None and plan.kind not in ("column", "template"):
        raise ConfigError(
            f"--image-column {spec.image_column!r} takes each row's text from --prompt-column or --template; "
            f"this job's prompts come from {'--messages-column' if plan.kind == 'messages' else '--format openai'}"
        )


@dataclass
class ImagePrompt:
    """What an image row gives the engine."""

    ids: list[int]
    images: dict[str, Any] | None  # the processor's image outputs (None: a text-only row)
    count: int  # images in the row


class ImagePrompts:
    """Builds each row's image prompt: the job's options, the model's processor, the recorded files."""

    def __init__(
        self,
        spec: JobSpec,
        plan: PromptPlan,
        processor: Any,
        max_model_len: int | None,
        sources: list[Source],
        recorded: dict[str, str | None] | None,
    ) -> None:
        self.column = spec.image_column  # None: image parts in --format openai lines or a messages column
        self.messages_column = plan.column if plan.kind == "messages" else None
        # how a row's error names its messages, as a text model's does (None: --image-column's one user message)
        self.where = (
            None if self.column is not None else "messages" if self.messages_column else "body.messages"
        )
        self.max_pixels = int(spec.max_image_pixels)
        self.processor = processor
        self.text = PromptBuilder(replace(plan, chat=False, system=None), processor.tokenizer, None)
        self.chat, self.system = plan.chat, plan.system
        self.kwargs = spec.template_kwargs
        self.max_model_len = max_model_len
        self.sources = {s.name: s for s in sources}
        self.recorded = recorded or {}  # the referenced files' digests the job recorded (images.json)
        self.remote: Any = None  # --allow-remote-images: the run's RemoteImages (None: URLs are row errors)

    def copy(self) -> ImagePrompts:
        """The same builder with its own processor (its tokenizer and image processor), for a worker thread
        (``job/ahead.py``): neither is made to be called from two threads at once."""
        other = copy.copy(self)
        other.processor = copy.deepcopy(self.processor)
        other.text = PromptBuilder(self.text.plan, other.processor.tokenizer, None)
        return other

    def build(self, row: Row) -> tuple[ImagePrompt | None, str | None]:
        """The row's prompt (its cell's images, then its text; or its messages with image parts), or its
        error (``row.place: what``)."""
        assert row.values is not None
        if self.column is None:
            return self._messages(row)
        text, error = self.text.text(row.values)
        pictures = None
        if text is not None and self.column not in row.values:
            error = f"image column {self.column!r} is missing in this row"
        elif text is not None:
            found, error = img.refs(row.values[self.column], self.column)
            if found is not None:
                pictures, error = self._load(found, row)
                error = None if pictures is not None else f"image column {self.column!r}: {error}"
        if text is None or pictures is None:
            return None, f"{row.place}: {error}"
        content = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": text}]
        return self._guarded(row, pictures, [{"role": "user", "content": content}] if self.chat else text)

    def build_openai(
        self, row: Row, base: SamplingParams, model_names: set[str] | None
    ) -> tuple[SamplingParams | None, ImagePrompt | None, str | None]:
        """An OpenAI Batch request line whose messages may hold image parts: its parameters and prompt, or
        its error."""
        from batchjob.job.requests import (
            CHAT_URL,
            COMPLETIONS_NO_KWARGS,
            COMPLETIONS_NO_SYSTEM,
            parse_request,
        )

        assert row.values is not None
        values, where = row.values, f"{row.place}: "
        body = values.get("body")
        if isinstance(body, str):
            with contextlib.suppress(ValueError):  # (else parse_request says so)
                body = json.loads(body)
        contents: list[Any] | None = None
        found: list[img.ImageRef] = []
        if isinstance(body, dict) and values.get("url") == CHAT_URL:
            contents, found, error = image_parts(body.get("messages"), "body.")
            if contents is None:
                return None, None, where + str(error)
            values = {**values, "body": {**body, "messages": text_only(body.get("messages"))}}
        request, params, error = parse_request(values, base, model_names, pictured(contents))
        if request is None or params is None:
            return None, None, where + str(error)
        if "prompt" in request:  # /v1/completions: the text as it is
            if self.system is not None:  # as for a text model: it has no place in the request's prompt
                return None, None, where + COMPLETIONS_NO_SYSTEM
            if self.kwargs:  # as for a text model: they would change nothing
                return None, None, where + COMPLETIONS_NO_KWARGS
            prompt, error = self._guarded(row, [], request["prompt"], system=False)
            return params, prompt, error
        if not self.chat:
            return (
                None,
                None,
                where + "a chat request needs a processor with a chat template; this one has none",
            )
        pictures, error = self._load(found, row)
        if pictures is None:
            return None, None, where + str(error)
        assert contents is not None
        prompt, error = self._guarded(row, pictures, with_images(request["messages"], contents))
        return params, prompt, error

    def _messages(self, row: Row) -> tuple[ImagePrompt | None, str | None]:
        """A messages column whose contents may hold OpenAI image parts."""
        assert row.values is not None and self.messages_column is not None
        if not self.chat:
            return (
                None,
                f"{row.place}: a messages column needs a processor with a chat template; this one has none",
            )
        messages, found, error = parse_messages(row.values.get(self.messages_column), self.messages_column)
        if messages is not None and self.text.plan.generation_prompt:  # as on a text model
            error = ends_answered(messages, self.messages_column)
            messages = None if error is not None else messages
        pictures = None
        if messages is not None:
            pictures, error = self._load(found, row)
        if messages is None or pictures is None:
            return None, f"{row.place}: {error}"
        return self._guarded(row, pictures, messages)

    def _load(self, found: list[img.ImageRef], row: Row) -> tuple[list[Any] | None, str | None]:
        source = self.sources.get(row.source)
        fetch = None if self.remote is None else self.remote.get
        if source is None:
            return img.load_refs(found, None, self.max_pixels, fetch=fetch)

        def seen(path: str, data: bytes) -> str | None:
            return self._check_recorded(source, path, data)

        return img.load_refs(found, img.source_folder(source), self.max_pixels, seen, fetch)

    def _check_recorded(self, source: Source, path: str, data: bytes) -> str | None:
        """Stop the job when a recorded file changed; a file unreadable when the job started and readable
        now is this row's error (its rows are all errors in this run, so that none reads another version)."""
        name = img.key(source, path)
        if name not in self.recorded:
            return None
        was = self.recorded[name]
        if was is None:
            return (
                f"image file {name} could not be read when the job started and can be now: its rows are "
                "error rows in this run (--retry-errors redoes them, reading the file as it is then)"
            )
        if img.digest(data) != was:
            raise img.ImageChangedError(
                f"image file {name} changed while the job ran (the rows committed so far are kept); "
                "run the job again to be told what differs"
            )
        return None

    def _guarded(
        self, row: Row, pictures: list[Any], prompt: Any, system: bool = True
    ) -> tuple[ImagePrompt | None, str | None]:
        """The processor's prompt (``system``: with --system); whatever it raises is this row's error."""
        try:
            return self._prompt(prompt, pictures, row, system)
        except Exception as e:  # noqa: BLE001 - a processor or template failure is this row's
            return None, f"{row.place}: the processor cannot build this row ({type(e).__name__}: {e})"[:2000]

    def _prompt(
        self, prompt: Any, pictures: list[Any], row: Row, system: bool
    ) -> tuple[ImagePrompt | None, str | None]:
        """``prompt``: the messages (content parts, images in place) or, without a chat template, the text."""
        rendered, error = self._render(prompt, self.system if system else None)
        if rendered is None:  # a message the template leaves out, named as a text model's row names it
            named = f"column {self.messages_column!r}: " if self.messages_column else ""
            return None, f"{row.place}: {named}{error}"
        chat = not isinstance(prompt, str)
        bos = getattr(self.processor.tokenizer, "bos_token", None)
        special = not (chat and bos is not None and rendered.startswith(bos))  # the processor's rule
        inputs = self.processor(
            images=pictures or None, text=rendered, return_tensors="pt", add_special_tokens=special
        )
        ids = [int(t) for t in inputs["input_ids"][0]]
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            return None, (
                f"{row.place}: prompt of {len(ids)} tokens (its images' included) does not fit the context of "
                f"{self.max_model_len} tokens (the model's, or --max-model-len)"
            )
        images = {k: v for k, v in inputs.items() if k not in NOT_IMAGE_INPUTS} if pictures else None
        return ImagePrompt(ids, images or None, len(pictures)), None

    def _render(self, prompt: Any, system: str | None) -> tuple[str | None, str | None]:
        """The prompt's text, or the error naming a message the chat template leaves out of it
        (``rendered.py``: every message's text but an assistant's must be in the render)."""
        if isinstance(prompt, str):
            return (prompt if system is None else f"{system}\n\n{prompt}"), None
        messages: list[dict[str, Any]] = list(prompt)
        given = system is not None and messages[0]["role"] != "system"
        if given:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
        rendered = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.kwargs
        )
        assert isinstance(rendered, str)
        missing = left_out(messages, rendered)
        return (rendered, None) if missing is None else (None, dropped(messages, missing, given, self.where))


def load_processor(model_folder: str | Path, trust_remote_code: bool) -> Any:
    """The model's processor (its chat template, its image preprocessing), from the loaded model's folder."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model_folder), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a folder without a processor is a setup error, named
        raise ConfigError(
            f"--image-column needs the model's processor; none could be loaded from {model_folder} "
            f"({type(e).__name__}: {e})"
        ) from e


def check_image_model(spec: JobSpec, model_config: Any | None = None) -> None:
    """Before the weights are read: ``--image-column`` needs a vision-language model (by its config), and so
    do the image options of a job whose requests or messages may hold image parts (on a text model such a
    part is its row's error: the options have no use); a prefill-only task (``--task``) needs a text model:
    on a vision-language model it is refused by name."""
    task = spec.engine.task
    options = spec.image_options if spec.image_column is None else []
    if spec.image_column is None and task == "generate" and not options:
        return
    import importlib.util

    if spec.image_column is not None and importlib.util.find_spec("PIL") is None:
        raise ConfigError(
            f"--image-column {spec.image_column!r} needs Pillow to read images: pip install 'batchjob[images]'"
        )
    from batchjob.engine.vision import check_family, is_vlm
    from batchjob.job.model_identity import display_name

    if model_config is None:
        from batchjob.models import load_config

        model_config, _ = load_config(spec.model, spec.trust_remote_code)
    kind = f"model {display_name(spec.model)!r} ({getattr(model_config, 'model_type', '?')})"
    if task != "generate" and is_vlm(model_config):
        raise ConfigError(
            f"--task {task}: {kind} is a vision-language model; the prefill-only tasks (embed, classify, "
            "score) run on text models only, with or without images: use a text model, or --task generate"
        )
    if spec.image_column is not None or options:
        check_family(model_config, images=True)  # (Fuyu, Chameleon: by family, not as text models)
    if spec.image_column is not None and not is_vlm(model_config):
        raise ConfigError(
            f"--image-column {spec.image_column!r}: {kind} is not a vision-language model; it takes no images"
        )
    if options and not is_vlm(model_config):
        raise ConfigError(
            f"this job has no use for {flags(options)}: {kind} is not a vision-language model, so an image "
            "part in a request or a message is its row's error; leave it out"
        )


def takes_images(spec: JobSpec, plan: PromptPlan, model_config: Any) -> bool:
    """Whether the job's rows are image rows, whose prompts the processor builds (``--image-column``, or
    ``--format openai`` and messages columns on a vision-language model: OpenAI content parts may hold
    images)."""
    from batchjob.engine.vision import is_vlm  # (the engine's modules load where a job needs them)

    parts = spec.format == "openai" or plan.kind == "messages"
    return spec.image_column is not None or (parts and is_vlm(model_config))


def check_image_render(spec: JobSpec, plan: PromptPlan, model_config: Any) -> bool:
    """Whether the job's rows are image rows (``takes_images``); if so, refuse before any work a processor's
    chat template that rejects or drops what every row gives it (``rendered.check_chat_render``: the
    --system message, and --image-column's user message), as a text model's tokenizer's is refused."""
    from batchjob.models import resolve_model  # (a hub id's folder, as the run loads it)

    if not takes_images(spec, plan, model_config):
        return False
    processor = load_processor(resolve_model(spec.model), spec.trust_remote_code)
    has_template = bool(getattr(processor, "chat_template", None))
    if has_template and spec.chat is not False:  # as image_prompts decides whether rows are rendered
        wraps = spec.image_column is not None
        check_chat_render(processor, plan.system, wraps, True, spec.template_kwargs, parts=True)
    return True


def check_job_render(spec: JobSpec, plan: PromptPlan, tokenizer: Any, model_config: Any) -> None:
    """The setup probe of the chat template that renders the job's prompts: the processor's for image rows,
    else the tokenizer's (``prompts.check_render``)."""
    if not check_image_render(spec, plan, model_config):
        check_render(spec, plan, tokenizer)


def image_prompts(spec: JobSpec, plan: PromptPlan, engine: Any, prep: Any) -> ImagePrompts | None:
    """The job's image prompt builder (None without ``--image-column``, or ``--format openai`` on a
    vision-language model): the loaded model's processor, whose chat template renders each row unless
    ``--no-chat``."""
    from batchjob.models import resolve_model

    if not takes_images(spec, plan, engine.model.config):
        return None

    processor = load_processor(engine.model_id or resolve_model(spec.model), spec.trust_remote_code)
    has_template = bool(getattr(processor, "chat_template", None))
    if spec.chat and not has_template:
        raise ConfigError("--chat asked for, but the model's processor has no chat template; use --no-chat")
    chat = has_template if spec.chat is None else spec.chat
    prompts = ImagePrompts(
        spec, replace(plan, chat=chat), processor, engine.max_model_len, prep.sources, prep.images
    )
    prompts.remote = prep.remote
    if prompts.remote is None and spec.allow_remote_images:  # (image parts not recorded: fetched as read)
        from batchjob.job.remote_images import RemoteImages

        prompts.remote = RemoteImages(spec.max_image_pixels)
    return prompts


def image_request(
    spec: JobSpec, images: ImagePrompts, base: SamplingParams, row: Row, model_names: set[str] | None = None
) -> tuple[SamplingParams | None, ImagePrompt | None, str | None]:
    """An image row's sampling parameters and prompt (an OpenAI line's, or ``--params-column`` and its
    cell's images), or the reason it has none: what a run makes of the row, and ``validate --estimate`` too."""
    assert row.values is not None
    if spec.format == "openai":
        return images.build_openai(row, base, model_names)
    params: SamplingParams | None = base
    if spec.params_column is not None:
        column = spec.params_column
        params, error = params_from_column(row.values.get(column), column, base)
        if params is None:
            return None, None, f"{row.place}: {error}"
    prompt, error = images.build(row)
    return params, prompt, error
