"""Keeps the buffers a forward frees in the process heap, instead of handing them back to the OS layer by layer.

A prompt chunk of 512 tokens makes a few 5 MB buffers per layer (the MLP's gate, up, their product). glibc's
malloc hands buffers over its mmap threshold straight back to the OS when they are freed, and trims the heap
whenever more than twice that threshold lies free at its top; each layer then asks for the same memory again,
and the OS zeroes it page by page on first touch. Measured at the Qwen2.5-0.5B shape in bf16 (16 requests of
128 + 32 tokens, 2 threads): 359,000 page faults a run and 1.9 s of kernel time, 15,000 and 0.4 s with the
heap kept (BENCHMARKS.md). :func:`keep_freed_memory` fixes the mmap threshold at glibc's largest (32 MiB) and
lets the heap keep up to 1 GiB free at its top: what a step frees, the next layer reuses, already in memory.
Peak memory does not change (those pages were in use at the peak); memory freed after it is kept for reuse.
It is called once the weights are loaded and packed, so loading returns its transient memory as before.
glibc on Linux only (elsewhere, or under another malloc, it does nothing); ``BATCHJOB_CPU_HEAP=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from batchjob import env

log = logging.getLogger(__name__)

DISABLE_ENV = "BATCHJOB_CPU_HEAP"
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit); larger buffers are mmapped
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept before it is trimmed

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; returns whether they are set (False off glibc or when off)."""
    global _done
    if _done:
        return True
    if not env.flag(DISABLE_ENV) or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: libc's (find_library would run ldconfig)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only: another malloc's mallopt differs
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first (setting it also stops glibc's moving it).
    mmap_set = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    _done = mmap_set and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.debug("mallopt refused the heap thresholds; freed buffers go back to the OS as before")
    return _done
