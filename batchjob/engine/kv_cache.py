"""KV storage: per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim], and how
many blocks the pool gets.

The arithmetic that needs no weights (blocks for a memory budget, whether one request of the full context
fits) is ``EngineConfig``'s, so ``batchjob validate`` can check a pool from a model's config alone. On CUDA,
without an explicit size, :func:`size_kv_pool` measures: the memory left of ``gpu_memory_utilization``
after the weights and a warm-up forward at the full token budget, less what that forward does not show.
"""

from __future__ import annotations

import torch

from batchjob.engine import cpu
from batchjob.engine.config import EngineConfig, KVShape
from batchjob.engine.cpu import Platform
from batchjob.engine.graphs import ROW_BUCKETS
from batchjob.engine.model_runner import ModelRunner
from batchjob.engine.plan import plan_kv
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.vision import memory as vision_memory
from batchjob.engine.vision.family import is_vlm
from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams

# KVShape: the shape the pool is sized by
__all__ = ["KVShape", "allocate_kv_cache", "plan_pool", "size_kv_pool"]


def allocate_kv_cache(
    shape: KVShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    platform: Platform | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, zeroed K and V caches, allocated by the device's platform hook (on the CPU one pool on
    huge pages)."""
    dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return (platform or cpu.platform(device)).allocate_kv(dims, shape.num_layers, dtype)


def plan_pool(model, config: EngineConfig, longest: int, tensor_parallel=None) -> tuple[KVShape, int]:
    """One rank's KV shape and the pool's blocks for requests of up to ``longest`` tokens (plan.py's plan,
    sized here by profiling where it says so; under tensor parallelism the smallest any rank holds), checked
    to hold one such request where the plan says so."""
    ranks = tensor_parallel.size if tensor_parallel is not None else 1
    kv_plan = plan_kv(model.config, config, longest, ranks)
    num_blocks = kv_plan.num_blocks or size_kv_pool(model, config, kv_plan.shape, kv_plan.longest)
    if tensor_parallel is not None:  # the same pool on every rank
        num_blocks = tensor_parallel.agree_min(num_blocks)
    kv_plan.check_pool(config, num_blocks)
    return kv_plan.shape, num_blocks


def size_kv_pool(model, config: EngineConfig, shape: KVShape, max_model_len: int) -> int:
    """The KV pool in blocks: as the settings say (``num_blocks``, ``kv_memory_gb``, the CPU default), else
    on CUDA what is left of ``gpu_memory_utilization`` after the weights and a warm-up forward."""
    planned = config.planned_num_blocks(shape, max_model_len)
    if planned is not None:
        return planned
    assert config.block_size is not None and config.max_num_batched_tokens is not None
    per_block = shape.bytes_per_block(config.block_size, config.dtype)
    _, total = torch.cuda.mem_get_info(config.device)
    peak = _profile_peak_memory(model, config, shape, max_model_len)
    budget = total * config.gpu_memory_utilization - peak - _cuda_reserve(model, config, peak)
    if budget < per_block:
        raise ConfigError(
            f"no GPU memory left for the KV cache: the model and a forward of "
            f"{config.max_num_batched_tokens} tokens peak at {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB; lower max_num_batched_tokens or raise gpu_memory_utilization"
        )
    return config.blocks_for_budget(shape, max_model_len, budget)


def _cuda_reserve(model, config: EngineConfig, peak: int) -> int:
    """Memory the warm-up forward does not show (an estimate): logits of every row that may sample in one
    step (with drafts, several per request; the sampler makes float32 copies), a vision-language model's
    tower call (``vision/memory.py``), and with CUDA graphs their pool, about the activations of a forward
    of the largest bucket."""
    assert config.max_num_batched_tokens is not None and config.max_num_seqs is not None
    assert config.num_speculative_tokens is not None
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + config.num_speculative_tokens))
    reserve = 3 * rows * vocab * 4
    if is_vlm(model.config):  # the vision tower's call over a step's images, which the warm-up does not run
        reserve += vision_memory.reserve_bytes(
            model.config, config.max_num_batched_tokens, config.dtype.itemsize
        )
    if config.cuda_graphs:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        graph_rows = min(ROW_BUCKETS[-1], config.max_num_batched_tokens)
        reserve += max(0, peak - weights) * graph_rows // config.max_num_batched_tokens
        reserve += graph_rows * vocab * 4  # the graphs' shared logits output (and slack)
    return reserve


def _profile_peak_memory(model, config: EngineConfig, shape: KVShape, max_model_len: int) -> int:
    """Peak CUDA memory of the weights plus one forward at the full token budget (a dummy prompt)."""
    bs, device = config.block_size, config.device
    assert bs is not None and config.max_num_batched_tokens is not None
    n = max(1, min(config.max_num_batched_tokens, max_model_len - 1))
    kv = allocate_kv_cache(shape, -(-n // bs), bs, config.dtype, device)
    runner = ModelRunner(model, kv, bs, device, attention_backend=config.attention_backend)
    req = Request("warmup", [0] * n, n, SamplingParams(max_new_tokens=1, temperature=0), 0.0)
    req.block_ids = list(range(-(-n // bs)))
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(SchedulerOutput([req], [n]))
    peak = torch.cuda.max_memory_allocated(device)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
    del kv, runner
    torch.cuda.empty_cache()
    return peak - kv_bytes
