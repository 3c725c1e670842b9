"""The engine's plan: what a model config and the options give an engine, and every refusal, before any
weight is read.

One copy of each check, called by ``Engine.__init__`` (with the loaded model) and by ``batchjob validate``
(``job/runner.py:check_engine``, from the model's config alone). Pure: no tensor is allocated and nothing is
loaded; only a pool sized "by profiling" (CUDA, no explicit size) is left to the engine (``kv_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchjob.engine import rope
from batchjob.engine.attention.registry import AttentionChoice, choose_attention
from batchjob.engine.config import EngineConfig, KVShape
from batchjob.engine.parallel.shard import check_shardable
from batchjob.engine.support import attention_features, check_supported
from batchjob.engine.vision import family as vision
from batchjob.errors import ConfigError


@dataclass(frozen=True)
class ModelPlan:
    """What the model and the options decide, the KV pool aside."""

    max_model_len: int  # the context a generation request may have, in tokens
    encoder: bool  # the model attends both ways within a row (it can only embed or classify)
    attention: AttentionChoice  # the backend and its block size


@dataclass(frozen=True)
class KVPlan:
    """The KV pool: its shape on one rank, its block size and size (None: sized at load by profiling)."""

    shape: KVShape  # one rank's (its share of the KV heads under tensor parallelism)
    block_size: int  # tokens per block
    num_blocks: int | None  # None: the engine measures the device's memory after loading the weights
    longest: int  # one request's tokens the pool must hold
    check: bool  # refuse a pool that cannot hold one request of ``longest`` tokens

    def check_pool(self, config: EngineConfig, num_blocks: int) -> None:
        """Raise ``ConfigError`` when the check is on and ``num_blocks`` cannot hold one longest request."""
        if self.check:
            config.check_kv_fits(num_blocks, self.longest)


def plan_model(model_config, config: EngineConfig, model=None, tensor_parallel: bool = False) -> ModelPlan:
    """Refuse a model our attention would answer wrongly (by name), one rank's shard outside its
    tensor-parallel engine (``tensor_parallel``: the engine is one), a tensor-parallel size the family
    cannot split, a ``max_model_len`` beyond its context, an encoder asked to generate or score, a
    vision-language family not built (or with what its images are not built for: vision/family.py)."""
    if vision.is_vlm(model_config):
        vision.check_family(model_config)
        vision.refuse(config, tensor_parallel or config.tensor_parallel_size > 1)
    check_supported(model_config, model)
    if getattr(model, "_batchjob_tp_shard", None) is not None and not tensor_parallel:
        raise ConfigError(
            "this model is one rank's shard of a tensor-parallel engine: it runs only in that engine "
            "(a second engine over it, e.g. --estimate's calibration, needs --tensor-parallel-size 1)"
        )
    if config.tensor_parallel_size > 1:
        check_shardable(model_config, config.tensor_parallel_size)
    max_model_len = config.resolve_max_model_len(model_config)
    rope.check(model_config, max_model_len, tensor_parallel or config.tensor_parallel_size > 1)
    features = attention_features(model_config, model)
    encoder = "bidirectional" in features
    if encoder and config.task not in ("embed", "classify"):
        raise ConfigError(
            f"model family {model_config.model_type!r} attends both ways (an encoder): it can embed or "
            f"classify (task='embed' or 'classify', --task), not {config.task}"
        )
    backend = config.attention_backend
    choice = choose_attention(config.device, config.dtype, features, config.block_size, backend)
    return ModelPlan(max_model_len, encoder, choice)


def plan_kv(model_config, config: EngineConfig, longest: int, ranks: int = 1) -> KVPlan:
    """The KV pool for requests of up to ``longest`` tokens on each of ``ranks`` tensor-parallel ranks.
    Checked (``check_pool``) when ``check_kv_pool`` says so, or by default when the engine sizes it."""
    shape = KVShape.from_config(model_config)
    if ranks > 1:  # each rank caches its own KV heads
        shape = shape.per_rank(ranks)
    assert config.block_size is not None
    check = bool(config.check_kv_pool or (config.check_kv_pool is None and config.num_blocks is None))
    return KVPlan(shape, config.block_size, config.planned_num_blocks(shape, longest), longest, check)
