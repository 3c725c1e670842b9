"""A job's LoRA adapters: ``--lora NAME=PATH`` entries (or a job file's ``[lora]`` table) checked into
``{name: path}``, with what adapters are not built with refused by name before any work; and their
identity by content, part of the job's fingerprint (a changed or renamed adapter is a different job).
"""

from __future__ import annotations

import os
from typing import Any

from batchjob.errors import ConfigError
from batchjob.io.identity import combine, folder_digest
from batchjob.job.model_identity import local_folder, model_names
from batchjob.job.seam import JobEngine


def lora_paths(entries: list[str], column: str | None, fmt: str, model: str | None) -> dict[str, str]:
    """``{name: path}`` of ``--lora`` entries, in the order given; refuses a malformed or repeated entry, an
    adapter column without adapters, several adapters with nothing to pick them by, and with --format openai
    an adapter known by a name of the base ``model`` (its requests would be the base's). Any task takes them
    (generate, and embed, classify and score: engine/tasks/adapters.py)."""
    paths: dict[str, str] = {}
    for entry in entries:
        name, eq, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ConfigError(f"--lora takes NAME=PATH, got {entry!r}")
        if name in paths:
            raise ConfigError(f"--lora names adapter {name!r} twice")
        paths[name] = path
    if column is not None and not paths:
        raise ConfigError("--adapter-column needs adapters: give --lora NAME=PATH")
    clash = sorted(set(paths) & model_names(model)) if fmt == "openai" and column is None else []
    if clash:
        raise ConfigError(
            f"--lora adapter {clash[0]!r} has a name of the base model: with --format openai a request's "
            "body.model picks its adapter, and the base model's name its base; give the adapter another name"
        )
    if len(paths) > 1 and column is None and fmt != "openai":
        raise ConfigError(
            f"{len(paths)} --lora adapters ({', '.join(paths)}): give --adapter-column to pick each row's"
        )
    return paths


def lora_identity(paths: dict[str, str]) -> dict[str, Any]:
    """Each adapter's files by content (a hub id not on this machine: by its id), by name, as they are now; an
    engine's adapters are known by the files it read (``held_identity``), the same digest over the same files."""
    out: dict[str, Any] = {}
    for name, path in paths.items():
        folder = local_folder(os.path.expanduser(path))  # as the engine loads it: '~/ad' is a folder
        out[name] = f"hub:{path}" if folder is None else combine(folder_digest(folder))
    return out


def held_identity(engine: JobEngine) -> dict[str, str]:
    """The engine's adapters by content as it loaded them (``Adapter.identity``: the bytes it computes with,
    whatever their folders hold now), by name."""
    held = engine.lora.adapters if engine.lora is not None else []
    return {a.name: a.identity for a in held}


def adapter_changes(want: dict[str, Any], have: dict[str, str], whose: tuple[str, str]) -> list[str]:
    """What differs between two ``{name: identity}`` (``whose``: how to call each side), in words."""
    lines = [f"{n!r} only in {whose[0]}" for n in want if n not in have]
    lines += [f"{n!r} only in {whose[1]}" for n in have if n not in want]
    return lines + [
        f"{n!r} is another adapter (other files)" for n in want if n in have and want[n] != have[n]
    ]


def check_adapters(
    paths: dict[str, str], config: Any, model_id: str, model_config: Any, encoder: bool, trust: bool = False
) -> None:
    """What the engine refuses of the adapters at load, checked before it (``validate``), by the engine's own
    checks: adapters with tensor parallelism or compile, a folder that is not PEFT's LoRA or holds what is not
    built (DoRA, trained biases, ...), ``modules_to_save`` but a classifier's head, the input embedding or
    the output head as a target (against the model built without weights), an adapter made for another base
    model. ``config``: the ``EngineConfig``; ``model_config``: the model's; ``encoder``: the model attends
    both ways (``plan.ModelPlan.encoder``); ``trust``: the job's ``trust_remote_code``."""
    from batchjob.engine import lora  # (the engine's package imports torch)
    from batchjob.engine.lora.peft_folder import check_base, check_targets, read_config, resolve_folder
    from batchjob.engine.tasks.adapters import task_heads
    from batchjob.models import model_skeleton

    if not paths:
        return
    lora.refuse(config, config.tensor_parallel_size > 1)
    heads = task_heads(config.task, encoder, getattr(model_config, "model_type", ""))
    skeleton = None
    for name, path in paths.items():
        adapter_config = read_config(name, resolve_folder(name, os.path.expanduser(path)), heads)
        check_base(name, adapter_config, model_id)
        skeleton = skeleton or model_skeleton(model_config, config.task, trust)  # once, for the first
        check_targets(name, adapter_config, skeleton)
