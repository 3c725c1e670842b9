"""KV storage: per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim], and how
many blocks the pool gets.

The arithmetic that needs no weights (blocks for a memory budget, whether one request of the full context
fits) is ``EngineConfig``'s, so ``batchjob validate`` can check a pool from a model's config alone. On CUDA,
without an explicit size, :func:`size_kv_pool` measures: the memory left of ``gpu_memory_utilization``
after the weights and a warm-up forward at the full token budget, less what that forward does not show.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchjob.errors import ConfigError

if TYPE_CHECKING:
    from batchjob.engine.config import EngineConfig

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVShape:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def _madvise_huge_pages(address: int, length: int) -> None:
    """Ask Linux for transparent huge pages on this range (a no-op elsewhere, or if it says no)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(_MADV_HUGEPAGE))
    except (OSError, AttributeError):
        pass


def _cpu_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU memory on 2 MiB pages where the OS offers them: decode attention reads blocks scattered
    over the whole pool, and huge pages spare it most TLB misses. Pages are advised before the zeroing
    touches them, so they are faulted in huge from the start."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE_PAGE
    buf = raw[start : start + nbytes]
    _madvise_huge_pages(buf.data_ptr(), nbytes // _HUGE_PAGE * _HUGE_PAGE)
    return buf.zero_().view(dtype)


def allocate_kv_cache(
    shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeros, not empty: attention reads padded and not-yet-written slots under a mask, and a NaN left in
    # uninitialised memory would survive a zero attention weight.
    dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    if device.type != "cpu":
        return [
            (torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device))
            for _ in range(shape.num_layers)
        ]
    per_tensor = num_blocks * block_size * shape.num_kv_heads * shape.head_dim
    pool = _cpu_zeros(2 * shape.num_layers * per_tensor, dtype).view(2 * shape.num_layers, *dims)
    return [(pool[2 * i], pool[2 * i + 1]) for i in range(shape.num_layers)]


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
    step (with drafts, several per request; the sampler makes float32 copies), and with CUDA graphs their
    pool, about the activations of a forward of the largest bucket."""
    from batchjob.engine.graphs import ROW_BUCKETS

    assert config.max_num_batched_tokens is not None and config.max_num_seqs is not None
    assert config.num_speculative_tokens is not None
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + config.num_speculative_tokens))
    reserve = 3 * rows * vocab * 4
    if config.cuda_graphs:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        graph_rows = min(ROW_BUCKETS[-1], config.max_num_batched_tokens)
        reserve += max(0, peak - weights) * graph_rows // config.max_num_batched_tokens
        reserve += graph_rows * vocab * 4  # the graphs' shared logits output (and slack)
    return reserve


def _profile_peak_memory(model, config: EngineConfig, shape: KVShape, max_model_len: int) -> int:
    """Peak CUDA memory of the weights plus one forward at the full token budget (a dummy prompt)."""
    from batchjob.engine.model_runner import ModelRunner
    from batchjob.engine.request import Request
    from batchjob.engine.scheduler import SchedulerOutput
    from batchjob.sampling import SamplingParams

    bs, device = config.block_size, config.device
    assert bs is not None and config.max_num_batched_tokens is not None
    n = max(1, min(config.max_num_batched_tokens, max_model_len - 1))
    kv = allocate_kv_cache(shape, -(-n // bs), bs, config.dtype, device)
    runner = ModelRunner(model, kv, bs, device)
    req = Request("warmup", [0] * n, n, SamplingParams(max_new_tokens=1, temperature=0), 0.0)
    req.block_ids = list(range(-(-n // bs)))
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(SchedulerOutput([req], [n]))
    peak = torch.cuda.max_memory_allocated(device)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
    del kv, runner
    torch.cuda.empty_cache()
    return peak - kv_bytes
