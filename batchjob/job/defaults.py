"""What an option left to its default stands for here, for a resumed job's identity check.

A job's fingerprint records options as given: ``dtype`` ``'auto'``, ``normalize`` and ``pooling`` None
("the engine decides"). A resume that spells a default out (``--dtype float32``, ``--no-normalize``) then
differs from the record in words only. Where what the default resolves to depends on nothing but the model,
whose content the fingerprint checks (an embedding model's sentence-transformers recipe, its context length
for ``--max-model-len``, its generation config's repetition penalty, its chat template for ``--chat``), the
same resolved value is no change. ``dtype``'s default depends on the machine as well (per device): a job
records what its ``auto`` ran in (``runs_in``), and a resume that spells that out (or a job started with it
and resumed with ``auto`` that resolves to it) is the same job (``same_dtype``); where the record can't say,
it stays a change, and the message says what the default resolves to here instead of the bare word.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.errors import BatchjobError
from batchjob.job.spec import JobSpec


@dataclass(frozen=True)
class Default:
    """A fingerprint entry's default: its recorded word, what it resolves to, and whether that is sure."""

    word: Any  # as the fingerprint records the default: 'auto', None
    value: Any  # what it resolves to now
    where: str  # why that value: "on cpu", "for this model"
    sure: bool  # the same wherever the job ran (a function of the model's content alone)

    def describe(self) -> str:
        return f"{self.word!r} (the default: {self.value!r} {self.where})"


def resolved_defaults(spec: JobSpec, column: str | None = None) -> dict[str, Default]:
    """The defaults of the fingerprint's entries (by their dotted names) as this machine and model resolve
    them; an entry whose default can't be resolved here is left out (its message stays the record's).
    ``column``: the prompt column this start resolved (the fingerprint's ``resolved_column``)."""
    from batchjob.engine.config import resolve_device, resolve_dtype

    out: dict[str, Default] = {}
    try:
        device = resolve_device(spec.engine.device)
        dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
        out["model.dtype"] = Default("auto", dtype, f"here, on {device.type}", sure=False)
    except BatchjobError:
        pass  # the run itself says what is wrong with the device
    if spec.engine.task == "embed":
        out |= _pooling_defaults(spec)
    if column in ("prompt", "text"):  # what no --prompt-column picks, of the job's columns (the input's)
        out["prompt.prompt_column"] = Default(None, column, "for these inputs", sure=True)
    return out | _model_defaults(spec)


def same_dtype(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two fingerprints' ``model`` entries run in one dtype: each its ``dtype`` as given, or for
    ``auto`` what it ran in (``runs_in``, recorded since 2026-12-07; a record without it can't say)."""

    def runs(entry: dict[str, Any]) -> Any:
        given = entry.get("dtype")
        return entry.get("runs_in") if given in (None, "auto") else given

    ran = runs(saved)
    return ran is not None and ran == runs(now)


def _model_defaults(spec: JobSpec) -> dict[str, Default]:
    """The defaults the model folder's own files settle: the context (``--max-model-len``), and for
    generation its repetition penalty and whether a plain prompt goes through its chat template."""
    from batchjob.engine.config import model_context_len  # (torch: only a refusal pays for it)
    from batchjob.job.model_identity import local_folder  # (as _pooling_defaults: a refusal's own imports)
    from batchjob.models import load_config, resolve_model  # (transformers' config: only a refusal reads it)

    folder = local_folder(resolve_model(spec.model))
    if folder is None:
        return {}  # a hub model not on this machine: its files can't be read yet
    where, out = "for this model", {}
    generate = spec.engine.task == "generate"
    with contextlib.suppress(BatchjobError):  # the model's own load says what is wrong with it
        context = model_context_len(load_config(str(folder), spec.trust_remote_code)[0])
        out[f"{'sampling' if generate else 'task'}.max_model_len"] = Default(None, context, where, sure=True)
    if not generate:  # a task reads a plain text as it is, unless --chat asks
        return out | {"prompt.chat": Default(None, False, f"for --task {spec.engine.task}", sure=True)}
    penalty = _folder_penalty(folder)
    if penalty is not None:
        out["sampling.repetition_penalty"] = Default(None, penalty, where, sure=True)
    if spec.image_column is None and spec.format == "rows":  # (an image model's template is its processor's)
        from batchjob.models import load_tokenizer  # (loads the tokenizer: only a refusal pays for it)

        with contextlib.suppress(BatchjobError):
            tokenizer = load_tokenizer(str(folder), spec.trust_remote_code)
            out["prompt.chat"] = Default(
                None, bool(getattr(tokenizer, "chat_template", None)), where, sure=True
            )
    return out


def _folder_penalty(folder: Path) -> float | None:
    """The repetition penalty the engine takes from the folder's generation_config.json (``model_penalty``:
    1 where it sets none), or None where that is not sure: a folder without the file whose config.json names
    one (transformers may build the generation config from it), or a file that can't be read."""
    own = folder / "generation_config.json"
    try:
        if not own.is_file():
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            return 1.0 if isinstance(config, dict) and config.get("repetition_penalty") is None else None
        value = json.loads(own.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    value = value.get("repetition_penalty") if isinstance(value, dict) else False
    if value is None:
        return 1.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _pooling_defaults(spec: JobSpec) -> dict[str, Default]:
    """--task embed: the pooling and normalisation the model folder's sentence-transformers files give."""
    from batchjob.engine.tasks.st_folder import resolve_pooling
    from batchjob.job.model_identity import local_folder
    from batchjob.models import resolve_model

    folder = local_folder(resolve_model(spec.model))
    if folder is None:
        return {}  # a hub model not on this machine: its files can't be read yet
    try:
        recipe = resolve_pooling(str(folder), None, None, None, 0)
    except BatchjobError:
        return {}  # a recipe batchjob does not run: the defaults resolve to nothing
    where = "for this model"
    return {
        "task.pooling": Default(None, recipe.mode, where, sure=True),
        "task.normalize": Default(None, recipe.normalize, where, sure=True),
    }
