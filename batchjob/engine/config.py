"""Engine configuration: the engine's options (declared in ``options.py``) resolved for the device: device
and dtype, batch limits and KV pool size.

Also the KV pool arithmetic that needs no weights (how many blocks a setting gives, whether one request of
the full context fits), so ``batchjob validate`` can check a pool from the model's config alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from batchjob.engine.attention.registry import choose_attention
from batchjob.engine.options import (
    DEFAULT_SPECULATIVE_TOKENS,
    DTYPE_CHOICES,
    EngineOptions,
    declared,
    device_default,
)
from batchjob.env import check_flags
from batchjob.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> KVShape:  # a transformers PretrainedConfig
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)

    def per_rank(self, ranks: int) -> KVShape:
        """What one of ``ranks`` tensor-parallel ranks caches: its share of the KV heads."""
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // ranks)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        return DTYPES[device_default("dtype", device.type) or "float32"]
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    return DTYPES[dtype]


@dataclass
class EngineConfig(EngineOptions):
    """The engine's options (each declared once, in ``EngineOptions``), checked and resolved for the device:
    after creation ``device`` is a ``torch.device``, ``dtype`` a ``torch.dtype``, and every limit that was
    None ("the engine decides") an integer."""

    def __post_init__(self) -> None:
        super().__post_init__()  # each given value checked; None: the declared default
        check_flags()  # the environment's switches (BATCHJOB_CPU_KERNEL=...), before any is read
        if not isinstance(self.device, torch.device):  # a torch.device is taken as its caller resolved it
            self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        # "The engine decides": per device, as the options declare (the KV budget stays None, its source
        # named in messages: see planned_num_blocks). ``decided``: the options left to the engine, which an
        # engine may decide another way where it knows better (an encoder's step budget: tasks/engine.py).
        self.decided = frozenset(f.name for f, _ in declared() if getattr(self, f.name) is None)
        for f, opt in declared():
            if getattr(self, f.name) is None and f.name != "kv_memory_gb":
                setattr(self, f.name, opt.device_default(self.device.type))
        if self.block_size is None:  # the attention backend's (each declares its own)
            self.block_size = choose_attention(
                self.device, self.dtype, backend=self.attention_backend
            ).block_size
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS
        if self.tensor_parallel_size > 1:
            self.cuda_graphs = False  # decode graphs would have to capture the ranks' collectives

    def decide_step_tokens(self, model_config: Any) -> None:
        """A generating engine's step budget on the CPU when the engine decides it: larger steps where the
        model's widest activation still fits (:func:`cpu_step_tokens`)."""
        if "max_num_batched_tokens" in self.decided and self.device.type == "cpu" and self.task == "generate":
            self.max_num_batched_tokens = cpu_step_tokens(model_config, self.dtype)

    def resolve_max_model_len(self, model_config: Any) -> int:
        """The context the engine accepts: ``max_model_len``, which may only shorten the model's own."""
        own = model_context_len(model_config)
        if self.max_model_len is None:
            return own
        if self.max_model_len > own:
            raise ConfigError(
                f"max_model_len {self.max_model_len} (--max-model-len) exceeds the model's context of {own} "
                "tokens; give at most that"
            )
        return self.max_model_len

    def planned_num_blocks(self, shape: KVShape, max_model_len: int) -> int | None:
        """The KV pool in blocks when the settings alone decide it (``num_blocks``, ``kv_memory_gb``, the CPU
        default); None when it is sized on CUDA by profiling the loaded model."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_memory_gb is not None:
            budget = self.kv_memory_gb * 2**30
        elif self.device.type == "cuda":
            return None
        else:
            budget = self.default_kv_memory_gb * 2**30
        return self.blocks_for_budget(shape, max_model_len, budget)

    def blocks_for_budget(self, shape: KVShape, max_model_len: int, budget: float) -> int:
        assert self.block_size is not None and self.max_num_seqs is not None
        per_block = shape.bytes_per_block(self.block_size, self.dtype)
        # Never more than every seat filled to the full context: beyond that blocks could not be used.
        useful = self.max_num_seqs * -(-max_model_len // self.block_size) + 1
        return max(1, min(useful, int(budget // per_block)))

    @property
    def kv_pool_source(self) -> str:
        """Which setting sized the KV pool, in the words of both the library and the command line."""
        if self.num_blocks is not None:
            return f"num_blocks={self.num_blocks} (--num-blocks)"
        if self.kv_memory_gb is not None:
            return f"kv_memory_gb={self.kv_memory_gb:g} (--kv-memory-gb)"
        if self.device.type == "cuda":
            return (
                f"the GPU memory left of gpu_memory_utilization={self.gpu_memory_utilization:g} "
                "(--gpu-memory-utilization) after the weights and a warm-up forward"
            )
        return f"the CPU default of {self.default_kv_memory_gb:g} GiB (--kv-memory-gb)"

    @property
    def default_kv_memory_gb(self) -> float:
        """The KV budget the engine decides on this device when none is given (the option's declaration)."""
        budget: float = device_default("kv_memory_gb", self.device.type)
        return budget

    def check_kv_fits(self, num_blocks: int, max_model_len: int) -> None:
        """Raise ``ConfigError`` unless ``num_blocks`` hold one request of ``max_model_len`` tokens."""
        bs = self.block_size
        assert bs is not None
        need = -(-max_model_len // bs)
        if num_blocks >= need:
            return
        tokens = num_blocks * bs
        raise ConfigError(
            f"the KV cache pool of {num_blocks} blocks x {bs} tokens = {tokens} tokens (sized by "
            f"{self.kv_pool_source}) cannot hold one request of the full context (max_model_len "
            f"{max_model_len} tokens, {need} blocks). Raise --kv-memory-gb or --num-blocks, or cap the "
            f"context with --max-model-len N (N <= {tokens})"
        )


CPU_STEP_TOKENS = (512, 2048)  # the CPU's step budgets: the default, and the larger where it fits
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest mmap threshold on 64-bit: larger blocks are always mapped


def cpu_step_tokens(model_config: Any, dtype: torch.dtype) -> int:
    """The CPU's step budget for a generating model: 2,048 tokens where a step's widest activation (the MLP's
    inner width, in ``dtype``) stays within glibc's largest mmap threshold, else 512. A prompt chunk of 2,048
    rows reads each weight once for four times the work, and the GEMMs read the weights from memory: at the
    Qwen2.5-0.5B shape in bf16 the bench's mixed workload ran 1.06x and 16 prompts of 128 tokens 1.06-1.12x
    faster than at 512 (CPU C, BENCHMARKS.md). Past the threshold every layer maps and faults its buffers
    afresh: at 2,048 tokens the 0.5B shape in float32 (40 MB) and the 1.5B shape in bf16 (37 MB) ran 1.1-1.16x
    slower, so they keep 512."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    if isinstance(inner, (list, tuple)):  # a width per layer (Gemma-3n)
        inner = max(inner)
    small, large = CPU_STEP_TOKENS
    widest = large * int(inner) * dtype.itemsize
    return large if 0 < widest <= MMAP_THRESHOLD_MAX else small


def model_context_len(model_config: Any) -> int:
    """The model's own context length, from its (text) config; 2048 when it names none."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
