"""Checks of a job's option values that need no ``JobSpec``: a value's type against its annotation, a finite
float, and which options mean something for which task.

They take the options as a mapping from each option's job name to its value (``JobSpec.values()``), so this
module imports nothing of the spec; the messages name options as the command line does (``--max-num-seqs``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import Field
from typing import Any

from batchjob.errors import ConfigError
from batchjob.job.options import JobOption
from batchjob.sampling import DRAW_ONLY, draw_only_given

# What each task computes, in words (messages).
TASK_RESULTS = {
    "embed": "an embedding",
    "classify": "a classifier head's scores",
    "score": "the text's log-likelihood",
}
# Options that only generation has: refused (when given) with the other tasks.
GENERATION_ONLY = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "choices",
    "json_schema",
    "regex",
    "n",
    "max_reasoning_tokens",
    "reasoning_tags",
    "params_column",
    "num_speculative_tokens",
)
EMBED_ONLY = ("pooling", "normalize", "dimensions", "prompt_name")


def flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def finite_float(name: str, value: Any) -> float:
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return number


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
}


def check_type(name: str, value: Any, annotation: Any) -> None:
    """Refuse ``value`` unless it has the type the annotation (its text: ``int | None``) names."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return
        raise ConfigError(f"{name} must be given, got nothing")
    if text.startswith("list"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} must be a list of strings, got {value!r}")
        return
    base = text.split(" | ")[0]
    ok = _TYPES.get(base, (object,))
    if isinstance(value, bool) and base != "bool" or not isinstance(value, ok):
        raise ConfigError(f"{name} must be {'a' if base != 'int' else 'an'} {base}, got {value!r}")


def check_task(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse, before any work, the options that mean nothing for the job's task, naming them. ``values``
    and ``defaults``: every option of the job by its job name."""
    task = values["task"]
    if task == "generate":
        _check_generation(values)
        return
    given = [n for n in GENERATION_ONLY if values[n] != defaults[n]]
    if task != "score" and values["logprobs"] is not None:
        given.append("logprobs")
    if task != "embed":
        given += [n for n in EMBED_ONLY if values[n] is not None]
    if task != "score" and values["score_column"] is not None:
        given.append("score_column")
    if given:
        raise ConfigError(
            f"{flags(given)} {'has' if len(given) == 1 else 'have'} no meaning for --task {task} "
            f"(it computes {TASK_RESULTS[task]} in one forward, without generating); leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )
    if values["format"] != "rows" and task != "embed":
        raise ConfigError(
            f"--format {values['format']} is for --task generate (chat and completions requests) and embed "
            f"(/v1/embeddings requests); --task {task} reads rows"
        )
    if values["logprobs"] is not None and values["logprobs"] != 0:
        raise ConfigError(
            f"--task score: --logprobs takes no K (got {values['logprobs']}); it adds the token_logprobs "
            "column, one log-probability per scored token"
        )
    score_column = values["score_column"]
    if score_column is not None and score_column in (values["prompt_column"], values["messages_column"]):
        raise ConfigError(
            f"--score-column {score_column!r} is also the prompt's column; the scored text comes "
            "after the prompt, from a column of its own"
        )
    if task == "score" and score_column is None and values["system"] is not None:
        raise ConfigError(  # every token of the text is scored: the system text's would be too
            "--system with --task score and no --score-column: the system text would go before each row's text "
            "and its tokens be scored with it; give the scored text with --score-column (the system text and "
            "the prompt stay unscored before it), or leave --system out"
        )


def _check_generation(values: Mapping[str, Any]) -> None:
    """A generation job: refuse the other tasks' options."""
    owners = {n: "embed" for n in EMBED_ONLY} | {"score_column": "score"}
    wrong = [n for n in owners if values[n] is not None] + (["truncate"] if values["truncate"] else [])
    if wrong:
        name = wrong[0]
        owner = owners.get(name, "embed, classify or score")
        raise ConfigError(
            f"{flags([name])} is an option of --task {owner}; this job generates text (--task "
            f"generate): give --task {owner.split(',')[0]}, or leave {flags([name])} out"
        )


def annotation(f: Field[Any], opt: Any) -> Any:
    """The type a job takes for the option declared by field ``f``: its own field's, or for an engine
    option (an ``Option``) its job type (``int | None`` where None is the default: the engine decides)."""
    if isinstance(opt, JobOption):
        return f.type
    return opt.kind.__name__ + (" | None" if f.default is None else "")


def home(path: Any) -> Any:
    """A local path with ``~`` expanded to the home folder (the part files' writer expanded it, the state's
    paths did not: a job's parts and state went to two places); anything else as it is."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


def check_special_texts(stops: list[str] | None, choices: list[str] | None, tokenizer: Any) -> None:
    """Refuse, before work, a job whose --stop holds a special token's text (every row was its error: never
    found) or whose --choices does (the label was scored as the token, not as its text)."""
    from batchjob.engine.features.stops import (  # (the engine's package imports torch)
        special_in_choices,
        special_in_stop,
    )
    from batchjob.engine.output import special_token_texts

    special = special_token_texts(tokenizer)
    why = special_in_stop(stops, special)
    if why is not None:
        raise ConfigError(f"--stop: {why}")
    why = special_in_choices(choices, special)
    if why is not None:
        raise ConfigError(f"--choices: {why}")


def check_tokenizer_texts(stops: list[str] | None, choices: list[str] | None, tokenizer: Any) -> None:
    """What ``validate`` and ``run`` refuse of the job's --stop and --choices for this tokenizer, before work
    (``check_special_texts``, ``check_choice_tokens``)."""
    check_special_texts(stops, choices, tokenizer)
    check_choice_tokens(choices, tokenizer)


def check_choice_tokens(choices: list[str] | None, tokenizer: Any) -> None:
    """Refuse, before work, --choices this tokenizer can't tell apart or spell: two labels it gives the same
    ids, or a label it gives none (the engine refuses such a label set at every row's admission)."""
    if not choices:
        return
    from batchjob.engine.constraints import choice_trie  # (the engine's package imports torch)

    try:
        choice_trie(tokenizer, choices)
    except ConfigError as e:
        raise ConfigError(
            f"--choices: {e} with this model's tokenizer (it normalizes the text, or drops or merges what it "
            "has no token for), so no answer could be that label alone; give labels it spells apart, each "
            "with a token at least"
        ) from e


IMAGE_OPTIONS = ("max_image_pixels", "allow_remote_images", "image_workers")


def prompt_kind(values: Mapping[str, Any]) -> str | None:
    """What a job's prompts come from as far as its options say (a ``PromptPlan``'s kind), or None where the
    input's columns decide (a 'messages' column, or 'prompt' or 'text': ``prompts.plan_prompts``)."""
    if values["format"] == "openai":
        return "openai"
    named = {"template": "template", "messages_column": "messages", "prompt_column": "column"}
    return next((kind for name, kind in named.items() if values[name] is not None), None)


def greedy_only(values: Mapping[str, Any]) -> bool:
    """Whether every row of a job decodes greedily: it generates at temperature 0 (given, or the default
    over rows) and no row can give its own (no params column, not --format openai: there the rows may)."""
    return (
        values["task"] == "generate"
        and values["format"] == "rows"
        and values["params_column"] is None
        and not values["temperature"]
    )


def unused_options(fmt: str, image_column: str | None, kind: str | None, greedy: bool = False) -> set[str]:
    """The options a job of this format has no use for (refused where given: ``check_unused``; an older job
    that recorded one resumes without it: ``prepare._unrecorded``): --chat with --format openai (each
    request's kind says), --check-model-name over rows, the image options over rows without images: a
    prompt column or a template (``kind``) without --image-column (a messages column's messages may hold
    image parts, as OpenAI requests' may; ``kind`` None: the input's columns decide, naming none of them),
    and the draw's options (--top-p, --top-k, --min-p, --seed) where every row is greedy (``greedy_only``)."""
    out = {"chat"} if fmt == "openai" else {"check_model_name"}
    if image_column is None and fmt == "rows" and kind in ("column", "template"):
        out |= set(IMAGE_OPTIONS)
    if greedy:
        out |= set(DRAW_ONLY)
    return out


def image_options_given(values: Mapping[str, Any], default_pixels: int) -> list[str]:
    """The image options a job was given (``IMAGE_OPTIONS`` not at their defaults), by job name."""
    given = {
        "max_image_pixels": values["max_image_pixels"] != default_pixels,
        "allow_remote_images": bool(values["allow_remote_images"]),
        "image_workers": values["image_workers"] is not None,
    }
    return [name for name in IMAGE_OPTIONS if given[name]]


_IMAGES = "a row's images: --image-column, or image parts in --messages-column or --format openai"
_DRAW_WHY = "a draw's: this job decodes greedily, at --temperature 0; give a --temperature above 0 to sample"
_UNUSED_WHY = {  # what each option is for, as the refusal says it
    "check_model_name": "it checks each request's body.model: --format openai",
    "max_image_pixels": _IMAGES,
    "allow_remote_images": _IMAGES,
    "image_workers": _IMAGES,
} | dict.fromkeys(DRAW_ONLY, _DRAW_WHY)


def check_unused(values: Mapping[str, Any], default_pixels: int, kind: str | None = None) -> None:
    """Refuse options a job would accept and never use (they were taken without a word): the name check of
    OpenAI requests over rows, the image options of a job without images, the draw's options of a job
    whose every row is greedy (30 of 30 rows were greedy's with --top-p 0.9 --top-k 20 --min-p 0.05
    --seed 3). ``default_pixels``: Pillow's; ``kind``: the prompts' kind once the input's columns have
    decided it (None: as the options say). (--chat with --format openai: ``JobSpec._check_openai`` says why.)"""
    given = ["check_model_name"] if values["check_model_name"] else []
    given += image_options_given(values, default_pixels) + draw_only_given(dict(values))
    kind = kind or prompt_kind(values)
    unused = unused_options(values["format"], values["image_column"], kind, greedy_only(values))
    by_why: dict[str, list[str]] = {}
    for name in (n for n in given if n in unused):
        by_why.setdefault(_UNUSED_WHY[name], []).append(name)
    if by_why:
        named = "; ".join(f"{flags(names)} ({why})" for why, names in by_why.items())
        several = sum(len(names) for names in by_why.values()) > 1
        raise ConfigError(f"this job has no use for {named}: leave {'them' if several else 'it'} out")


def choice_scoring(choices: list[str] | None, logprobs: bool, per_row: bool, sampled: bool) -> str | None:
    """How a job's --choices rows are answered, where an earlier batchjob answered them otherwise (its
    identity records it: an earlier job's is refused on resume), or None. 'whole labels': a label another one
    goes on from (scored in log space; greedy's pick the whole label's best), log-probabilities (the answer's
    own tokens'). 'whole labels, sampled too': a sampled label is drawn from the whole labels' probabilities
    (it was the token walk's: 'ab' beside 'c' came 0.72 of the time at a probability of 1e-5). ``sampled``:
    the job's temperature is above 0 or its rows may give one; a params column may give any of them."""
    labels = choices or []
    prefix = any(b != a and b.startswith(a) for a in labels for b in labels)
    if per_row or (labels and sampled):
        return "whole labels, sampled too"
    return "whole labels" if labels and (logprobs or prefix) else None
