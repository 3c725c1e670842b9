"""A model's identity by content, so that a job never mixes the answers of two models.

The identity is a digest over the model folder's files (config, tokenizer, chat template, weights, code): each
file by its size and content digest (``batchjob.io.identity``: small files whole, weight files by samples,
and those also whole, read once per file and machine: ``weight_digests.py``).
It does not depend on how the model was named: the embedded default model is the same model whether it is
given as nothing, ``default`` or its hub id, and a folder moved elsewhere is still the same model. Weights
replaced at the same path are a different model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchjob.io.identity import combine, folder_digest
from batchjob.job.weight_digests import whole_digests

_NOT_MODEL = ("readme", "license", "notice", "changelog")


def _skip(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1].lower()
    return name.endswith(".md") or name.startswith(_NOT_MODEL)


def local_folder(resolved: str) -> Path | None:
    """The folder holding a resolved model: itself, or a hub id's snapshot in the Hugging Face cache."""
    path = Path(resolved)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved, local_files_only=True))
    except Exception:  # not cached (yet): the identity is settled once the model has been downloaded
        return None


def model_files(resolved: str) -> dict[str, str] | None:
    """``{file: "<size>:<digest>"}`` of a resolved model, or None while it is not on this machine."""
    folder = local_folder(resolved)
    return None if folder is None else folder_digest(folder, _skip)


def display_name(model: str | None) -> str:
    """How outputs name the model: a hub id as given, a folder by its name, else the default model's name."""
    if model in (None, "", "default"):
        from batchjob.models import DEFAULT_MODEL

        return DEFAULT_MODEL
    return Path(str(model)).name if Path(str(model)).exists() else str(model)


def model_names(model: str | None) -> set[str]:
    """The names a request may give this job's model (``--check-model-name``; a LoRA adapter takes none)."""
    from batchjob.models import DEFAULT_MODEL  # (as display_name: models.py is only needed here)

    names = {display_name(model)}
    if model not in (None, "", "default"):
        names.add(str(model))
    if DEFAULT_MODEL in names:
        names.add(f"HuggingFaceTB/{DEFAULT_MODEL}")
    return names


def identity(files: dict[str, str] | None, resolved: str, model: str | None = None) -> dict[str, Any]:
    """The model part of a job's fingerprint (``name`` is for display only: it is never compared). ``whole``:
    the sampled files' whole digests (weight_digests.py), beside ``content``, which keeps its old meaning."""
    name = display_name(model if model is not None else resolved)
    if files is None:
        return {"hub_id": resolved, "name": name}
    out = {"content": combine(files), "files": files, "name": name}
    sampled = [rel for rel, digest in files.items() if ":sampled:" in digest]
    folder = local_folder(resolved) if sampled else None
    return out | ({"whole": whole_digests(folder, sampled)} if folder is not None else {})


def changes(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What changed between two model identities, in words (None when they are the same model). A file
    both record whole (a job made before recorded only samples of its weights) is compared whole."""
    old_whole, new_whole = saved.get("whole") or {}, now.get("whole") or {}
    edited = sorted(f for f in set(old_whole) & set(new_whole) if old_whole[f] != new_whole[f])
    if edited:
        return "model files: " + ", ".join(f"{f} changed (same size and sampled bytes)" for f in edited)
    if saved.get("content") == now.get("content") and saved.get("hub_id") == now.get("hub_id"):
        return None
    old, new = saved.get("files") or {}, now.get("files") or {}
    if not old or not new:
        return (
            f"model: was {saved.get('hub_id') or 'a local model'}, now {now.get('hub_id') or 'a local model'}"
        )
    lines = [f"{f} changed" for f in sorted(set(old) & set(new)) if old[f] != new[f]]
    lines += [f"{f} removed" for f in sorted(set(old) - set(new))]
    lines += [f"{f} added" for f in sorted(set(new) - set(old))]
    return "model files: " + ", ".join(lines)
