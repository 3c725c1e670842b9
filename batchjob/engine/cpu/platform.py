"""The device's hooks into the engine: the few places where a device needs more than torch does everywhere.

:class:`Platform` is every device's: it does nothing beyond plain torch. :class:`CpuPlatform` is the CPU's:
it packs linear weights for oneDNN at load (:mod:`.linear`: float32, and bf16 where the CPU has native bf16,
:mod:`.bf16`), gives a vision tower the prefill kernels' attention (:mod:`.tower`) and RMS norms a kernel call
(:mod:`.rows`), keeps the buffers
forwards free in the heap (:mod:`.heap`), allocates the KV pool as memory
the OS fills on first touch (:func:`lazy_zeros`), and checks between steps whether other programs share our
cores (:mod:`.spin`). The engine and the model runner call the hooks and never ask which device they run on.
"""

from __future__ import annotations

import mmap

import torch

from batchjob import env
from batchjob.engine.cpu import bf16, heap, linear, rows, tower
from batchjob.engine.cpu.spin import SpinGuard

SPIN_GUARD_ENV = "BATCHJOB_CPU_SPIN_GUARD"

KVPool = list[tuple[torch.Tensor, torch.Tensor]]


class Platform:
    """Hooks of a device that needs nothing special (CUDA)."""

    # Whether the KV pool takes memory only as blocks are first written, so the block manager should reuse
    # released blocks before it takes new ones (its ``grow``); CUDA's pool is taken whole either way.
    grows_kv = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare_model(self, model: torch.nn.Module, dtype: torch.dtype, compiled: bool) -> int:
        """Adapt the loaded model to the device; returns how many layers were changed."""
        return 0

    def allocate_kv(self, dims: tuple[int, int, int, int], num_layers: int, dtype: torch.dtype) -> KVPool:
        """Per layer, K and V caches of shape ``dims``, zeroed: attention reads padded and not-yet-written
        slots under a mask, and a NaN left in uninitialised memory would survive a zero attention weight."""
        return [
            (
                torch.zeros(dims, dtype=dtype, device=self.device),
                torch.zeros(dims, dtype=dtype, device=self.device),
            )
            for _ in range(num_layers)
        ]

    def before_step(self) -> bool:
        """Called at the start of every engine step; True when the step runs in a busy machine's mode."""
        return False

    def idle(self) -> None:
        """Called when the engine has no request left."""


def lazy_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU memory that the OS fills page by page as each is first touched: an anonymous mapping, so
    the pool holds memory only for the blocks written so far (the block manager reuses released blocks
    before it takes new ones), not its whole budget at load. Its pages are the kernel's ordinary ones: a
    private mapping on transparent huge pages was measured no faster on the bench's mixed workload at the
    Qwen2.5-0.5B shape in bf16 (BENCHMARKS.md, 2026-12-04), so nothing asks for them."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:  # neither mmap nor frombuffer takes an empty buffer
        return torch.zeros(0, dtype=dtype)
    region = mmap.mmap(-1, nbytes)  # anonymous: zero-filled on first touch
    return torch.frombuffer(region, dtype=dtype)  # the tensor keeps the mapping alive


class CpuPlatform(Platform):
    """The CPU's hooks. ``spin_guard``: whether to watch for other programs on our cores (the engine's
    runner does; a runner built alone, to measure or test, does not)."""

    grows_kv = True

    def __init__(self, device: torch.device, spin_guard: bool = True) -> None:
        super().__init__(device)
        self.spin_guard: SpinGuard | None = None
        if spin_guard and env.flag(SPIN_GUARD_ENV):  # on unless BATCHJOB_CPU_SPIN_GUARD=0
            guard = SpinGuard(device)
            self.spin_guard = guard if guard.enabled else None

    def prepare_model(self, model: torch.nn.Module, dtype: torch.dtype, compiled: bool) -> int:
        """Pack the model's float32 linear weights for oneDNN, and bf16 ones where the CPU has native bf16
        (not under torch.compile: inductor lowers the packed call only for weights it froze itself). bf16 on
        a CPU without it is slower than float32: one warning line says so. Then, the load done, the heap keeps
        what the forwards free (:mod:`.heap`). A vision tower attends on the prefill kernels (:mod:`.tower`),
        and the RMS norms of the Llama layout run one kernel call each (:mod:`.rows`)."""
        bf16.warn_if_slow(self.device, dtype)
        packed = 0
        if not compiled and linear.available(dtype, self.device):
            packed = linear.prepack_linears(model)
        if not compiled:  # the kernels are ctypes calls, which torch.compile cannot trace
            tower.use_for_tower(model, dtype)
            rows.fuse_norms(model)
        heap.keep_freed_memory()
        return packed

    def allocate_kv(self, dims: tuple[int, int, int, int], num_layers: int, dtype: torch.dtype) -> KVPool:
        """One zeroed pool, every layer's K and V a view of it, its pages taken as blocks are
        first written (the block manager grows it on demand: ``grows_kv``)."""
        per_tensor = dims[0] * dims[1] * dims[2] * dims[3]
        pool = lazy_zeros(2 * num_layers * per_tensor, dtype).view(2 * num_layers, *dims)
        return [(pool[2 * i], pool[2 * i + 1]) for i in range(num_layers)]

    def before_step(self) -> bool:
        if self.spin_guard is None:
            return False
        self.spin_guard.check()
        return self.spin_guard.on

    def idle(self) -> None:
        if self.spin_guard is not None:
            self.spin_guard.release()  # leave the OpenMP runtime as we found it
