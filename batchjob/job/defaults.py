"""What an option left to its default stands for here, for a resumed job's identity check.

A job's fingerprint records options as given: ``dtype`` ``'auto'``, ``normalize`` and ``pooling`` None
("the engine decides"). A resume that spells a default out (``--dtype float32``, ``--no-normalize``) then
differs from the record in words only. Where what the default resolves to depends on nothing but the model,
whose content the fingerprint checks (an embedding model's sentence-transformers recipe), the same resolved
value is no change; where it depends on the machine as well (``dtype``: per device), it stays a change, and
the message says what the default resolves to here instead of printing the record's bare word.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def resolved_defaults(spec: JobSpec) -> dict[str, Default]:
    """The defaults of the fingerprint's entries (by their dotted names) as this machine and model resolve
    them; an entry whose default can't be resolved here is left out (its message stays the record's)."""
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
    return out


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
