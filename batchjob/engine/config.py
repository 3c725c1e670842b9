"""Engine configuration: resolved device and dtype, batch limits and KV pool size, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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
            raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


DEFAULT_SPECULATIVE_TOKENS = 4  # most prompt-lookup drafts a request takes per step (it starts at one)


@dataclass
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    max_num_batched_tokens: int | None = None  # tokens per forward; None: a default for the device
    max_num_seqs: int | None = None  # running requests at once; None: a default for the device
    block_size: int | None = None  # tokens per KV block; None: 256 where flash-attn runs, else 16
    num_blocks: int | None = None  # None: size the pool from kv_memory_gb (or free memory on CUDA)
    kv_memory_gb: float | None = None  # KV pool budget; None: a default for the device
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory for weights, activations and KV
    enable_prefix_caching: bool = True  # share computed blocks of equal prefixes between requests
    static_batching: bool = False  # the baseline: admit a batch, then nothing until all of it finished
    num_speculative_tokens: int | None = None  # prompt-lookup drafts per request and step; None: 4; 0: off
    # Steps without prompt chunks replay CUDA graphs bucketed by rows; None: on for CUDA. True on a CPU runs
    # the same padded buckets eagerly (nothing to capture there; the tests use it).
    cuda_graphs: bool | None = None
    compile: bool = False  # run the model under torch.compile (attention stays eager)

    def __post_init__(self) -> None:
        cuda = self.device.type == "cuda"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if cuda else 512
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if cuda else 64
        if self.block_size is None:
            from batchjob.engine.attention import flash_attn_usable

            self.block_size = 256 if flash_attn_usable(self.device, self.dtype) else 16
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.cuda_graphs is None:
            self.cuda_graphs = cuda
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64:
            raise ConfigError(f"num_speculative_tokens must be an integer in [0, 64], got {k!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ConfigError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ConfigError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb!r}")
