"""LoRA adapters in a prefill-only engine: every step's rows gathered by adapter, and a classifier
adapter's own head.

The generating engine adds a step's updates masked (every present adapter's rank columns for every row,
then a mask: layers.py), which is exact but sums in an order that depends on the step's mix of adapters.
A task engine promises that a row's floats never depend on what shares its step, so its ``LoraStep`` is
always gathered (each adapter's rows selected: a base row takes no update, as in a step without adapters),
and each target layer's forward is this module's: a row's two low-rank products are its own (a batch of
one-row products, ``torch.bmm``), since a GEMM's rounding of a row changes with the number of rows it is
given (MKL takes another path below four rows). The base layers are row-alike already (the CPU's packed
oneDNN weights; tests/engine/test_tasks.py), and so are the adapters' own heads, packed the same way.

PEFT saves a sequence-classification adapter with its fine-tuned head (``task_type="SEQ_CLS"`` puts
``classifier`` and ``score`` in ``modules_to_save``, their full tensors in ``adapter_model.safetensors``).
Each such adapter gets its own copy of the model's head modules with those tensors (unpacked: plain
layers), and a row is read through its adapter's head, or the model's for base rows and adapters that saved
none (as PEFT's wrapper keeps the base head's copy). A saved module other than the task head is refused by
name (peft_folder.py); embed and score take no saved modules.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from batchjob.engine import lora
from batchjob.engine.lora.peft_folder import LoraWeights
from batchjob.engine.tasks.runner import TaskRunner, classifier
from batchjob.errors import ConfigError


def head_modules(model: Any, tasks: TaskRunner) -> tuple[str, ...]:
    """The modules of ``model`` a classify adapter's ``modules_to_save`` may replace (what
    ``runner.classifier`` applies after the body); none for embed and score."""
    return task_heads(tasks.task, tasks.encoder, model.config.model_type)


def task_heads(task: str, encoder: bool, model_type: str) -> tuple[str, ...]:
    """``head_modules`` of a task's model from what its config says (``validate`` checks adapters with it):
    an encoder (``plan.ModelPlan.encoder``) classifies with ``classifier``, a causal model with ``score``."""
    if task != "classify":
        return ()
    if not encoder:
        return ("score",)
    return ("classifier", "head") if model_type == "modernbert" else ("classifier",)


def attach_to(engine: Any, paths: lora.Paths, sharded: bool) -> lora.Adapters:
    """Load ``paths`` into a new task engine: always gathered, each classifier adapter with its head."""
    model = engine.model
    heads = head_modules(model, engine.tasks)
    adapters = lora.attach_to(engine, paths, sharded, heads=heads, gathered=True)
    for index, adapter in enumerate(adapters.adapters, start=1):
        own: dict[str, Any] = {n: _own_module(engine, adapter, n) for n in heads if _has(adapter, n)}
        pooler = _outside_the_body(engine, adapter, heads)
        if pooler is not None:
            own["pooler"] = pooler
        if own:
            engine.tasks.heads[index] = classifier(model, engine.tasks.encoder, own)[1]
    _rewrap(model, adapters)
    return adapters


def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` ([M, K] @ [K, N]) as M one-row products: a row's floats do not depend on M."""
    return torch.bmm(x[:, None, :], w.expand(x.shape[0], *w.shape))[:, 0]


def _rewrap(model: torch.nn.Module, adapters: lora.Adapters) -> None:
    """Every target layer's forward: its own, plus the update of each of the step's adapters on their
    gathered rows, in one-row products."""
    step = adapters.step
    per_module: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for index, adapter in enumerate(adapters.adapters, start=1):
        for name, w in adapter.layers.items():
            per_module.setdefault(name, {})[index] = _transposed(w)
    for name, weights in per_module.items():
        module = model.get_submodule(name)
        module.forward = types.MethodType(_forward(module._batchjob_lora_base, step, weights), module)


def _transposed(w: LoraWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """A.T [in, r] and (B * scale).T [r, out]: views of the stacked weights (layers.py folds the scale into
    B), a copy only where the scale is not folded."""
    return w.a.T, (w.b.T if w.scale == 1.0 else (w.b * w.scale).T.contiguous())


def _forward(base, step: lora.LoraStep, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        rows = step.rows
        mine = [i for i in weights if i in step.present] if rows is not None else []
        if not mine:
            return out
        assert rows is not None
        out = out if out.is_contiguous() else out.contiguous()
        flat_x, flat = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for i in mine:
            at, bt = weights[i]
            flat.index_add_(0, rows[i], rowwise(rowwise(flat_x.index_select(0, rows[i]), at), bt))
        return out

    return forward


def _outside_the_body(engine: Any, adapter: lora.Adapter, heads: tuple[str, ...]):
    """LoRA targets that read a row or two after the body, not the step's packed rows: the head (refused)
    and BERT's ``pooler.dense``. The body's forward computes the pooler for nothing (no result reads it
    there): it goes back to its own forward. With embed its update is left out (it changes nothing an
    embedding reads, in PEFT's model too); with classify, whose head reads it, the adapter's own pooler is
    returned (None when the adapter has no update there)."""
    model = engine.model
    found = next((m for n, m in model.named_modules() if n.rpartition(".")[2] == "pooler"), None)
    pooler = None
    for target in list(adapter.layers):
        name, _, leaf = target.rpartition(".")
        module = model.get_submodule(target)
        if found is not None and name and model.get_submodule(name) is found and leaf == "dense":
            module.forward = module._batchjob_lora_base  # the forward's pooler: plain
            weights = adapter.layers.pop(target)
            if engine.task == "classify":
                pooler = _lora_pooler(found, weights)
            continue
        if (
            any(target == h or target.startswith(f"{h}.") for h in heads)
            or found is not None
            and any(module is m for m in found.modules())
        ):
            raise ConfigError(
                f"LoRA adapter {adapter.name!r} targets {target!r}, read after the model's body: not "
                f"supported with task={engine.task!r} (a fine-tuned head comes as modules_to_save)"
            )
    return pooler


def _lora_pooler(pooler: Any, weights: LoraWeights):
    """BERT's pooler (``activation(dense(first token))``) with the adapter's update beside ``dense``, for
    the head's rows [R, 1, H]."""
    at, bt = _transposed(weights)

    def apply(h: torch.Tensor) -> torch.Tensor:
        x = h[:, 0]
        return pooler.activation(pooler.dense(x) + rowwise(rowwise(x, at), bt))

    return apply


PACKED_KEYS = ("_batchjob_packed", "_batchjob_joint")  # what cpu/linear.py gives a packed layer


def _has(adapter: lora.Adapter, name: str) -> bool:
    return any(key.startswith(f"{name}.") for key in adapter.head)


def _own_module(engine: Any, adapter: lora.Adapter, name: str) -> torch.nn.Module:
    """A copy of the model's module ``name`` holding the adapter's tensors of it (every one: a tensor missing
    or of another shape is refused by name), prepared for the device as the model was (the CPU's packed
    weights: cpu/linear.py; a packed layer of the model is copied without its packed weight)."""
    module, device = engine.model.get_submodule(name), engine.device
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            memo[id(param)] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device), False
            )
        for key in PACKED_KEYS:
            packed = sub.__dict__.get(key)
            if packed is not None:
                memo[id(packed)] = None
    own = copy.deepcopy(module, memo)
    for sub in own.modules():
        sub.__dict__.pop("forward", None)  # a packed layer's forward: back to its class's
        for key in PACKED_KEYS:
            sub.__dict__.pop(key, None)
    state = {k[len(name) + 1 :]: t for k, t in adapter.head.items() if k.startswith(f"{name}.")}
    try:
        own.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        raise ConfigError(
            f"LoRA adapter {adapter.name!r}: its saved {name} does not fit this model's ({detail})"
        ) from None
    engine.platform.prepare_model(own.eval(), engine.dtype, engine.config.compile)
    return own
