"""An engine the caller built, given to ``run_job(spec, engine=...)``: the job runs on it only where it is the
engine the spec asks for.

The job records the spec's identity (``prepare.py``: the model by content, its dtype, the adapters, the task
and the engine options the identity names). Rows an engine with another model, dtype or context computed would
be written under that identity, and a later ``batchjob run`` with the spec's options would take them for its
own ("already complete"). So each difference is refused before any work, naming the setting and both values.

A spec that names no model takes the engine's (``take_model``), so that the job records the model that runs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from batchjob.engine.options import EngineOptions, declared
from batchjob.errors import ConfigError
from batchjob.job import model_identity
from batchjob.job.defaults import resolved_defaults
from batchjob.job.kernels import kernels_entry
from batchjob.job.lora import adapter_changes, held_identity
from batchjob.job.prepare import Prepared, task_entry
from batchjob.job.seam import JobEngine
from batchjob.job.spec import JobSpec
from batchjob.job.state import differing, fingerprint_changes

_BUILD = (
    "build the engine from the spec (Engine.from_pretrained(spec.model, options=spec.engine, "
    "lora=spec.lora_paths or None)), or leave engine out and run_job loads it"
)


def take_model(spec: JobSpec, engine: JobEngine | None) -> JobSpec:
    """The spec, with the given engine's model where it names none: the job then records the model that runs
    (not the embedded default model, which a spec without a model stands for)."""
    if engine is None or spec.model is not None:
        return spec
    return dataclasses.replace(spec, model=_model_folder(engine))


def check_given_engine(prep: Prepared, engine: JobEngine | None) -> None:
    """Refuse an engine that is busy with other requests, or is not the one the spec asks for
    (``ConfigError``, naming the setting, both values and how to go on): another task or model, another dtype, other LoRA adapters, another value of an
    engine option the job's identity records (``max_model_len``; a task's pooling, chunks and kernels), or a
    KV pool that can't hold one request of its context (the job's own engine refuses that at load). None:
    no engine was given (the job loads its own)."""
    if engine is None:
        return
    if engine.num_unfinished:  # the loop routes every finished request to a row: another's has none
        raise ConfigError(
            f"run_job needs an idle engine; it has {engine.num_unfinished} unfinished requests: step it "
            "until has_unfinished() is False, or give run_job an engine of its own"
        )
    spec = prep.spec
    if engine.config.task != spec.engine.task:
        raise ConfigError(
            f"run_job: the engine computes task {engine.config.task!r}, the spec asks for "
            f"{spec.engine.task!r}; {_BUILD}"
        )
    _check_model(prep, engine)
    _check_dtype(prep, engine)
    _check_adapters(prep, engine)
    _check_options(prep, engine)
    engine.config.check_kv_fits(engine.stats.num_blocks, engine.prefill_limit)


def _model_folder(engine: JobEngine) -> str:
    if not engine.model_id:
        raise ConfigError(
            "run_job: the engine given does not say where its model came from (its model_id is empty: it was "
            "not loaded by Engine.from_pretrained), so the job can't record the model by content; load it "
            "with Engine.from_pretrained, or leave engine out"
        )
    return engine.model_id


def _check_model(prep: Prepared, engine: JobEngine) -> None:
    """The engine's model is the spec's, by content (``model_identity.py``), wherever each was loaded from."""
    folder = _model_folder(engine)
    now = model_identity.identity(model_identity.model_files(folder), folder)
    saved = prep.model_check or prep.fingerprint["model"]["identity"]  # a resumed hub model's: the record's
    change = model_identity.changes(saved, now)
    if change is None:
        return
    named = prep.spec.model if prep.spec.model is not None else "the embedded default model"
    raise ConfigError(
        f"run_job: the engine holds another model than the spec's: the engine's is {folder}, the spec's "
        f"{named} ({change}); give make_spec(model={folder!r}), or {_BUILD}"
    )


def _check_dtype(prep: Prepared, engine: JobEngine) -> None:
    """The engine runs in the dtype the job records: the spec's, or what its ``auto`` resolves to (``runs_in``,
    per the spec's device)."""
    from batchjob.engine.config import resolve_dtype  # (torch: the engine is loaded anyway)

    entry = prep.fingerprint["model"]
    given = str(entry.get("dtype") or "auto").removeprefix("torch.")
    want = entry.get("runs_in") if given == "auto" else given
    if want is None:  # the spec's device did not resolve: its auto as the engine's device resolves it
        want = str(resolve_dtype("auto", engine.config.device)).removeprefix("torch.")
    have = str(engine.config.dtype).removeprefix("torch.")
    if want == have:
        return
    said = f"'auto' (here {want})" if given == "auto" else repr(given)
    raise ConfigError(
        f"run_job: the engine runs in {have}, the spec's dtype is {said}; give make_spec(dtype={have!r}), or "
        f"build the engine with dtype={want!r}"
    )


def _check_adapters(prep: Prepared, engine: JobEngine) -> None:
    """The engine holds the spec's LoRA adapters, each by name and content, and no others (with --format
    openai a request may name any adapter the engine holds). The engine's by the files it read when it loaded
    them: a folder rewritten since (a training run's next checkpoint) holds another adapter than it computes."""
    want: dict[str, Any] = prep.fingerprint.get("lora") or {}
    have = held_identity(engine)
    if want == have:
        return
    lines = adapter_changes(want, have, ("the spec", "the engine"))
    raise ConfigError(
        f"run_job: the engine's LoRA adapters are not the spec's: {', '.join(lines)} (the engine's as it "
        f"loaded them); {_BUILD}"
    )


def _check_options(prep: Prepared, engine: JobEngine) -> None:
    """The engine options the job's identity records (``sampling.max_model_len``; a task's options, chunks and
    kernels), as the engine was given them, against the spec's: the same identity entries computed for a spec
    with the engine's options. A default spelled out at what it resolves to for this model is no difference."""
    spec = prep.spec
    built = copy.copy(spec)  # (no __post_init__: the spec's own options were checked when it was made)
    built.engine = given_options(engine)
    have = str(engine.config.dtype).removeprefix("torch.")
    now: dict[str, Any] = {"sampling": built.sampling_fingerprint()}
    if "task" in prep.fingerprint:
        now["task"] = task_entry(built, {"dtype": have})
    else:  # a generation job's kernels (kernels.py): an engine on another backend rounds otherwise
        now["kernels"] = kernels_entry(built.engine)
    saved = {k: prep.fingerprint.get(k, {}) for k in now}
    if not differing(saved, now):
        return
    column = prep.fingerprint.get("prompt", {}).get("resolved_column")  # (only a difference pays for these)
    changes = fingerprint_changes(saved, now, resolved_defaults(spec, column), ("the spec's", "the engine's"))
    if changes:
        raise ConfigError(
            f"run_job: the engine was built with other settings than the spec's: {'; '.join(changes)}; give "
            f"make_spec the engine's values, or {_BUILD}"
        )


def given_options(engine: JobEngine) -> EngineOptions:
    """The options the engine was built with, as given: None where the engine decided (``decided``)."""
    config = engine.config
    given: dict[str, Any] = {
        f.name: None if f.name in config.decided else getattr(config, f.name) for f, _ in declared()
    }
    given |= {"device": str(config.device), "dtype": str(config.dtype).removeprefix("torch.")}
    return EngineOptions(**given)
