"""Tensor parallelism on one node: one engine whose forward runs on N ranks, each with 1/N of the weights.

``Engine.from_pretrained(..., tensor_parallel_size=N)`` (``--tensor-parallel-size N``) goes through
:func:`load_engine`: the family's plan is checked from its config first (shard.py refuses what it cannot
split, by name), then rank 0 starts the other ranks (group.py), every rank loads its shard, and rank 0's
engine is returned. Everything above the forward (scheduler, KV block allocation,
sampling, checkpoints) runs on rank 0 only; the other ranks replay its steps (follower.py).

A rank reads only its share of each weight where the safetensors keys are the model's parameters one to one
(load.py: dense Llama, Qwen2, Qwen3, Mistral...). Elsewhere (fused MoE experts, .bin, GGUF, a model's own
code) it reads the whole checkpoint and keeps its shard, so loading needs one model's memory per rank for a
moment; one log line says which and why.
"""

from __future__ import annotations

import logging
from typing import Any

from batchjob.engine.parallel.group import Group
from batchjob.engine.parallel.load import load_shard
from batchjob.engine.parallel.shard import check_shardable, plan_of, shard_model
from batchjob.engine.vision import family as vision
from batchjob.models import load_config, load_model_and_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

__all__ = ["check_shardable", "load_engine", "plan_of"]


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    """Options a follower can read from JSON (a torch.device or dtype as its name)."""
    out = {}
    for k, v in options.items():
        if type(v).__module__.split(".")[0] == "torch":
            v = str(v).removeprefix("torch.")
        out[k] = v
    return out


def load_model(model: str | None, config, trust_remote_code: bool, group) -> tuple[Any, Any, str]:
    """This rank's shard of the model on its device: read by slice where the checkpoint allows (load.py),
    else the whole model loaded and sliced (one log line says why)."""
    model_config, resolved = load_config(model, trust_remote_code)
    tokenizer = load_tokenizer(model, trust_remote_code)
    hf_model, why = load_shard(
        resolved, model_config, config, group.rank, group.size, group.device, group.all_reduce
    )
    if hf_model is not None:
        return hf_model, tokenizer, resolved
    if group.rank == 0:
        log.info("tensor parallelism: every rank loads all of %s and keeps its shard: %s", resolved, why)
    hf_model, tokenizer, resolved = load_model_and_tokenizer(
        model, config.dtype, group.device, trust_remote_code=trust_remote_code, task=config.task
    )
    shard_model(hf_model, group.rank, group.size, group.all_reduce)
    return hf_model, tokenizer, resolved


def load_engine(engine_cls, model: str | None, config, options: dict[str, Any], trust_remote_code: bool):
    """Rank 0's engine over ``config.tensor_parallel_size`` ranks (the others started here)."""
    model_config, _ = load_config(model, trust_remote_code)
    if vision.is_vlm(model_config):  # refused by name before any rank starts or reads a weight
        vision.check_family(model_config)
        vision.refuse(config, sharded=True)
    check_shardable(model_config, config.tensor_parallel_size)
    spec = {"model": model, "options": _plain(options), "trust_remote_code": trust_remote_code}
    group = Group.start(config.tensor_parallel_size, config.device, spec)
    try:
        hf_model, tokenizer, resolved = load_model(model, config, trust_remote_code, group)
        group.wait_ready()
        group.connect()
        return engine_cls(hf_model, tokenizer, config, model_id=resolved, tensor_parallel=group)
    except BaseException:
        group.close(force=True)
        raise
