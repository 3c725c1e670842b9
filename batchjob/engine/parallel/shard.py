"""Splitting a loaded model's weights across tensor-parallel ranks, by the family's own plan.

transformers declares, per family, which linears are column-parallel and which row-parallel
(``base_model_tp_plan`` in the config class). We read that plan but shard ourselves, in place, with plain
tensors: ``from_pretrained(tp_plan=...)`` in transformers 5.x goes through DTensor and did not shard the tiny
models on CPU/gloo when tried (and we want to own what each rank holds, and where the all-reduces are).

- ``colwise``: a linear's output features split in N contiguous slices (its bias likewise). q/k/v slices
  are whole heads, so each rank's attention runs on its own query and KV heads.
- ``rowwise``: a linear's input features split likewise; its output is a partial sum, all-reduced (sum)
  by a forward hook, and its bias kept on rank 0 only (added once by the sum).
- ``packed_colwise``: an experts tensor ``[E, 2 * I, H]`` of gate and up halves, each half split.
- ``rowwise`` on an experts tensor ``[E, H, I]``: the last axis split; ``moe_tp_experts``: the experts
  module's output all-reduced.

What is not in the plan (embeddings, norms, the router, the head) stays whole on every rank. A family
whose config has no plan, a plan entry of another kind, or head counts not divisible by N is refused by name
(:func:`check_shardable`) before any weight is read. Qwen2-MoE's shared expert is outside its plan and is
split here like a dense MLP, so the block's output is one sum.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from batchjob.errors import ConfigError

# "replicated_with_grad_allreduce" (Qwen3's per-head q/k norms) matters for training only: kept whole here.
KINDS = {"colwise", "rowwise", "packed_colwise", "moe_tp_experts", "replicated_with_grad_allreduce"}
# Qwen2-MoE's shared expert, outside transformers' plan, split the same way (see the module docstring).
EXTRA_PLAN = {
    "layers.*.mlp.shared_expert.gate_proj": "colwise",
    "layers.*.mlp.shared_expert.up_proj": "colwise",
    "layers.*.mlp.shared_expert.down_proj": "rowwise",
}

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


def plan_of(config) -> dict[str, str]:
    """The family's tensor-parallel plan (module path pattern -> kind), with our additions."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if plan and getattr(config, "model_type", "") == "qwen2_moe":
        plan.update(EXTRA_PLAN)
    return plan


# family -> the config setting that gives it per-head weights its tensor-parallel plan leaves whole (Cohere's
# q/k LayerNorms of [heads, head_dim]: a rank's share of the heads would meet every head's weights)
_PER_HEAD_OUTSIDE_PLAN = {"cohere": "use_qk_norm"}


def check_shardable(config, n: int) -> None:
    """Raise ``ConfigError`` unless the model can run on ``n`` tensor-parallel ranks."""
    if n == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(text, "model_type", "?")
    plan = plan_of(text)
    if not plan:
        raise ConfigError(
            f"model family {family!r} has no tensor-parallel plan (base_model_tp_plan in its transformers "
            f"config), so it cannot run with tensor_parallel_size {n} (--tensor-parallel-size); run it with "
            "1 (use --devices for data parallelism)"
        )
    other = sorted({k for k in plan.values() if k not in KINDS})
    if other:
        raise ConfigError(
            f"model family {family!r}: its tensor-parallel plan uses {', '.join(other)}, which batchjob does "
            f"not implement; run it with --tensor-parallel-size 1"
        )
    setting = _PER_HEAD_OUTSIDE_PLAN.get(family)
    if setting is not None and getattr(text, setting, False):
        raise ConfigError(  # each rank would keep every head's weights for its share of the heads
            f"model family {family!r} with {setting}: its per-head norm weights are outside its tensor-parallel "
            f"plan (transformers leaves them whole), so it cannot run with tensor_parallel_size {n}; run it "
            "with --tensor-parallel-size 1 (use --devices for data parallelism)"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads, "KV heads": kv_heads}
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(getattr(text, name, None), int):
            sizes[name] = getattr(text, name)
    for what, count in sizes.items():
        if count % n:
            raise ConfigError(
                f"model family {family!r} has {count} {what}, not divisible by tensor_parallel_size {n} "
                "(--tensor-parallel-size); pick a size that divides it"
            )


def _matches(plan: dict[str, str], path: str) -> str | None:
    generic = re.sub(r"\.\d+\.", ".*.", path)
    return plan.get(generic)


def bounds(size: int, rank: int, n: int) -> tuple[int, int]:
    """The [start, end) of ``rank``'s share of ``size`` items over ``n`` ranks (``torch.chunk``'s split)."""
    step = -(-size // n)
    start = min(size, rank * step)
    return start, min(size, start + step)


def linear_rule(kind: str, name: str) -> tuple[int | None, bool]:
    """How a ``kind`` linear's tensor ``name`` (weight or bias) is shared: (the dim split over the ranks, or
    None when every rank keeps it whole; whether ranks other than 0 hold zeros instead). The one place both
    :func:`shard_model` and the shard-only loader (load.py) take it from."""
    if kind == "colwise":
        return 0, False
    if kind == "rowwise":
        return (1, False) if name == "weight" else (None, True)  # the bias is added once, by rank 0's sum
    raise ConfigError(f"tensor-parallel plan: {kind} on a linear is not implemented")


def _piece(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    start, end = bounds(t.shape[dim], rank, n)
    return t.narrow(dim, start, end - start).contiguous()


def shard_model(model: torch.nn.Module, rank: int, n: int, all_reduce: AllReduce) -> int:
    """Shard ``model`` in place for ``rank`` of ``n`` by its family's plan; returns how many modules
    were split. Row-parallel outputs get ``all_reduce`` as a forward hook."""
    plan = plan_of(model.config)
    count = 0
    model._batchjob_tp_shard = (rank, n)  # (Engine refuses a shard outside its tensor-parallel engine)

    def reduce_output(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        all_reduce(out)
        return output

    with torch.no_grad():
        for path, module in model.base_model.named_modules():
            kind = _matches(plan, path)
            if kind is None or kind == "replicated_with_grad_allreduce":
                continue
            if isinstance(module, torch.nn.Linear):
                if kind not in ("colwise", "rowwise"):
                    raise ConfigError(f"tensor-parallel plan: {kind} on linear {path} is not implemented")
                for name in ("weight", "bias"):
                    param = getattr(module, name)
                    dim, zero = linear_rule(kind, name)
                    if param is None:
                        continue
                    if dim is not None:
                        setattr(module, name, torch.nn.Parameter(_piece(param, dim, rank, n), False))
                    elif zero and rank:
                        param.zero_()
                if kind == "colwise":
                    module.out_features //= n
                else:
                    module.in_features //= n
                    module.register_forward_hook(reduce_output)
                count += 1
            elif kind == "moe_tp_experts":
                _shard_experts(module, path, plan, rank, n)
                module.register_forward_hook(reduce_output)
                count += 1
    return count


def _shard_experts(module: torch.nn.Module, path: str, plan: dict[str, str], rank: int, n: int) -> None:
    """Split a fused experts module's tensors: gate/up ``[E, 2I, H]`` by halves, down ``[E, H, I]``."""
    for name, param in list(module.named_parameters(recurse=False)):
        kind = _matches(plan, f"{path}.{name}")
        if kind == "packed_colwise":
            gate, up = param.data.chunk(2, dim=1)
            new = torch.cat([_piece(gate, 1, rank, n), _piece(up, 1, rank, n)], dim=1)
        elif kind == "rowwise":
            new = _piece(param.data, param.dim() - 1, rank, n)
        elif name.endswith("bias") and kind is None and param.dim() == 2 and "down" in name:
            new = param.data if rank == 0 else torch.zeros_like(param.data)
        elif kind is None:
            raise ConfigError(
                f"tensor-parallel plan: experts tensor {path}.{name} has no entry; cannot split it"
            )
        else:
            raise ConfigError(
                f"tensor-parallel plan: {kind} on experts tensor {path}.{name} is not implemented"
            )
        setattr(module, name, torch.nn.Parameter(new.contiguous(), requires_grad=False))
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, getattr(module, attr) // n)


def bytes_per_rank(model: torch.nn.Module, n: int) -> tuple[int, int]:
    """What one of ``n`` ranks holds of ``model``'s weights under its plan, without loading anything (a model
    on the meta device will do): (bytes of the split tensors' shares, bytes of the tensors kept whole)."""
    plan = plan_of(model.config)
    split = whole = 0
    for path, param in model.named_parameters():
        inner = path.split(".", 1)[1] if path.startswith(model.base_model_prefix + ".") else path
        module_path, _, name = inner.rpartition(".")
        kind = _matches(plan, inner) or _matches(plan, module_path)
        size = param.numel() * param.element_size()
        if kind in ("colwise", "rowwise", "packed_colwise") and not (kind == "rowwise" and name == "bias"):
            split += size // n
        else:
            whole += size
    return split, whole
