"""Giving back the pages of a checkpoint file's mapping once a layer no longer reads them.

transformers loads a safetensors checkpoint as views of one mapping of the file. Packing a layer's weight
(linear.py) reads it, so its pages become resident, and they stay resident (counted in the process's RSS)
until the whole mapping goes, after the last layer: for a while the model is held twice. Here, right after
a layer is packed and its own weight dropped, the whole pages of that weight's byte range are handed back
with ``madvise(MADV_DONTNEED)``, so the peak at load is the packed copies and one layer, not two models.

Only pages of a private *file* mapping of a ``.safetensors`` file (from /proc/self/maps; torch maps the file
copy-on-write) are ever given back, and only those of a weight the model no longer reads (the packed copy
replaced it): should anything touch them later, the kernel reads the file again. Anonymous memory (a weight converted to another dtype at load) is never touched here; it is
freed by the usual reference counting when the dropped weight goes. Linux only; elsewhere nothing happens.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_DONTNEED = 4  # linux/mman.h


class FilePages:
    """The private safetensors mappings of this process as read once, and the madvise call that hands back
    whole pages inside them."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if (
                        len(parts) == 6
                        and parts[1].endswith("p")
                        and parts[5].strip().endswith(".safetensors")
                    ):
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        self.ranges.append((start, end))
            libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's (no ldconfig run)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except OSError:
            self.ranges = []

    def release(self, tensor: torch.Tensor) -> int:
        """Hand back the whole pages of ``tensor``'s bytes where they lie in a safetensors mapping; returns
        the bytes handed back (0 where the tensor is not in one, or nothing could be)."""
        if not self.ranges or self._madvise is None or tensor.device.type != "cpu":
            return 0
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return 0
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the range only
        if last <= first:
            return 0
        return last - first if self._madvise(first, last - first, MADV_DONTNEED) == 0 else 0
