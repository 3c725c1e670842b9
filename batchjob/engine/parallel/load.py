"""Shard-only loading: a tensor-parallel rank reads just its share of each weight from the safetensors files.

The model is built on the meta device (no weights allocated), split by :func:`shard.shard_model` there (the
same code, so the same shapes, hooks and plan rules as a full load), and then each parameter is read as one
slice, ``safe_open(...).get_slice(key)[...]``, straight onto the rank's device in its dtype. Non-persistent
buffers (rotary ``inv_freq``) are computed by the model's own ``_init_weights``, as ``from_pretrained`` does.

It applies only where the checkpoint's keys are the model's parameters one to one (dense Llama, Qwen2,
Qwen3, Mistral...). Anything else returns the reason, and the caller falls back to full load + slice:
transformers' weight conversions (fused MoE experts), ``.bin`` or GGUF checkpoints, a hub model not in the
local cache, a model's own code, or modules kept in float32.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from batchjob.engine.parallel.shard import _matches, bounds, linear_rule, plan_of, shard_model
from batchjob.models import load_generation_config

SPLIT_KINDS = ("colwise", "rowwise")


def _auto_class(task: str) -> Any:
    return {"embed": AutoModel, "classify": AutoModelForSequenceClassification}.get(
        task, AutoModelForCausalLM
    )


def checkpoint_files(resolved: str) -> tuple[Path, dict[str, Path], str | None]:
    """The model's folder and the safetensors file of each checkpoint key in it, for model folder (or cached
    hub model) ``resolved``; ``(folder, {}, reason)`` where there is none to read by slice."""
    folder = Path(resolved)
    if not folder.is_dir():
        try:
            folder = Path(
                snapshot_download(resolved, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
            )
        except (OSError, ValueError) as e:
            return folder, {}, f"hub model {resolved!r} is not in the local cache ({type(e).__name__})"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return folder, {key: folder / file for key, file in weight_map.items()}, None
    single = folder / "model.safetensors"
    if not single.is_file():
        return folder, {}, "its checkpoint is not safetensors"
    with safe_open(str(single), framework="pt") as f:
        return folder, dict.fromkeys(f.keys(), single), None


def _share(model: torch.nn.Module, plan: dict[str, str], full_name: str) -> tuple[int | None, bool]:
    """(dim split, zeros off rank 0) for parameter ``full_name``, by :func:`shard.linear_rule`."""
    module_path, _, name = full_name.rpartition(".")
    prefix = model.base_model_prefix + "."
    if model.base_model is not model and not module_path.startswith(prefix):
        return None, False  # outside the base model (the head): whole, as shard_model leaves it
    inner = module_path.removeprefix(prefix) if model.base_model is not model else module_path
    kind = _matches(plan, inner)
    if kind in SPLIT_KINDS and isinstance(model.get_submodule(module_path), torch.nn.Linear):
        return linear_rule(kind, name)
    return None, False


def load_shard(
    resolved: str, config: Any, engine_config: Any, rank: int, n: int, device: torch.device, all_reduce
) -> tuple[torch.nn.Module | None, str | None]:
    """``rank``'s shard of the model, read by slice; ``(None, reason)`` where this model needs a full load.
    ``config``: the model's transformers config; ``engine_config``: the engine's (dtype, task)."""
    if getattr(config, "auto_map", None):
        return None, "it ships its own code"
    folder, files, reason = checkpoint_files(resolved)
    if reason:
        return None, reason
    dtype = engine_config.dtype
    with torch.device("meta"):
        model = _auto_class(engine_config.task).from_config(config, dtype=dtype)
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        return None, "it keeps modules in float32"
    params = dict(model.named_parameters())  # tied ones once, under their first name
    persistent = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in params}
    persistent = {k: v for k, v in persistent.items() if not any(v is p for p in params.values())}
    wanted = set(params) | set(persistent)
    if set(files) != wanted:
        extra, missing = sorted(set(files) - wanted), sorted(wanted - set(files))
        return None, f"its checkpoint keys are not the model's parameters (e.g. {(extra + missing)[0]!r})"
    plan = plan_of(config)
    shares = {key: _share(model, plan, key) for key in params}
    aliases = [(name, p) for name, p in model.named_parameters(remove_duplicate=False) if name not in params]
    # Non-persistent buffers are computed by _init_weights, which must not touch weights: buffer-only modules.
    owners = {name.rpartition(".")[0] for name, _ in model.named_buffers() if name not in persistent}
    reason = _unsupported_plan(model, plan, owners)
    if reason:
        return None, reason
    shard_model(model, rank, n, all_reduce)  # on meta: shapes, in/out features and hooks, no data

    with ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(str(file), "pt")) for file in set(files.values())}
        reads = {key: opened[files[key]] for key in files}
        index, reason = _slices(model, reads, shares, rank, n)
        if reason:
            return None, reason
        _read(model, reads, shares, index, persistent, rank, device, dtype)
    for name, first in aliases:  # tied weights: the same tensor again, as from_pretrained ties them
        _put(model, name, model.get_parameter(next(key for key, p in params.items() if p is first)))
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            _put(model, name, torch.empty_like(buffer, device=device))
    for path in owners:
        model._init_weights(model.get_submodule(path))  # rotary inv_freq, as from_pretrained computes it
    _generation_config(model, folder)
    model.eval()
    return model, None


def _unsupported_plan(model: PreTrainedModel, plan: dict[str, str], owners: set[str]) -> str | None:
    """Why the model can't be loaded by slice under ``plan`` (fused experts split, a module computing buffers
    beside its weights), or None."""
    experts = [
        p for p, _ in model.base_model.named_modules() if _matches(plan, p) not in (None, *SPLIT_KINDS)
    ]
    if any(_matches(plan, p) != "replicated_with_grad_allreduce" for p in experts):
        return "its plan splits fused experts"
    for path in sorted(owners):
        if any(True for _ in model.get_submodule(path).parameters(recurse=False)):
            return f"module {path} computes buffers beside its weights"
    return None


def _slices(
    model: torch.nn.Module,
    reads: dict[str, Any],
    shares: dict[str, tuple[int | None, bool]],
    rank: int,
    n: int,
) -> tuple[dict[str, list[slice]], str | None]:
    """The index of ``rank``'s share of each parameter in its checkpoint tensor (``reads``: the open file of
    each key); every share's shape is checked against the sharded model before anything is read."""
    index = {}
    for key, (dim, _) in shares.items():
        shape = list(reads[key].get_slice(key).get_shape())
        index[key] = [slice(None)] * len(shape)
        full = tuple(shape)
        if dim is not None:
            start, end = bounds(shape[dim], rank, n)
            index[key][dim], shape[dim] = slice(start, end), end - start
        want = tuple(model.get_parameter(key).shape)
        if tuple(shape) != want:
            return index, f"checkpoint tensor {key!r} of shape {full} does not split into {want}"
    return index, None


def _read(
    model: torch.nn.Module,
    reads: dict[str, Any],
    shares: dict[str, tuple[int | None, bool]],
    index: dict[str, list[slice]],
    persistent: dict[str, Any],
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Every parameter's share and every persistent buffer, read onto ``device`` in ``dtype``."""
    for key, (dim, zero) in shares.items():
        if zero and rank:  # not read: rank 0's copy is added once, by the sum
            value = torch.zeros(model.get_parameter(key).shape, dtype=dtype, device=device)
        else:
            value = reads[key].get_slice(key)[tuple(index[key])]
            value = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        _put(model, key, torch.nn.Parameter(value, requires_grad=dim is None and not zero))
    for key in persistent:
        value = reads[key].get_tensor(key).to(device)
        _put(model, key, value.to(dtype) if value.is_floating_point() else value)


def _put(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Set parameter or buffer ``name`` (a dotted path) of ``model`` to ``value``, keeping its kind."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    if leaf in module._parameters:
        module._parameters[leaf] = value
    else:
        module._buffers[leaf] = value


def _generation_config(model: torch.nn.Module, folder: Path) -> None:
    """The folder's generation config, as from_pretrained reads it: its generation_config.json, else one made
    of its config.json (its eos ids, its repetition penalty and the settings the engine refuses)."""
    if getattr(model, "generation_config", None) is None:
        return
    model.generation_config = load_generation_config(str(folder))
