"""The step's batch layout as every attention backend receives it, and the one host-to-device copy.

The model runner turns a scheduler plan into a :class:`StepLayout` (numpy, host side, backend-neutral);
each backend reads what it needs of it and adds its own index arrays to the step's :class:`Packer`, which
sends them to the device with the runner's own arrays in a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class Packer:
    """Collects int64 arrays, sends them to the device in one copy, hands back device views."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0

    def add(self, a: np.ndarray) -> tuple[int, tuple[int, ...]]:
        a = np.ascontiguousarray(a, dtype=np.int64)
        handle = (self._size, a.shape)
        self._parts.append(a.ravel())
        self._size += a.size
        return handle

    def send(self, device: torch.device) -> torch.Tensor:
        buf = torch.from_numpy(np.concatenate(self._parts) if self._parts else np.zeros(0, np.int64))
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        return buf

    @staticmethod
    def view(buf: torch.Tensor, handle: tuple[int, tuple[int, ...]]) -> torch.Tensor:
        start, shape = handle
        return buf[start : start + int(np.prod(shape, dtype=np.int64))].view(shape)


def ramps(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c - 1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclass
class StepLayout:
    """One step's packed sequence of T rows from R requests (host side)."""

    ids: np.ndarray  # [T] token of each packed row
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] flat KV slot each row's key and value go to
    table: np.ndarray  # [R, max_blocks] block table of each request (0-padded)
    req_of_row: np.ndarray  # [T]
    starts: np.ndarray  # [R] tokens computed before this step
    n: np.ndarray  # [R] rows this step
    ends: np.ndarray  # [R] keys each request attends to after this step (starts + n)
    offsets: np.ndarray  # [R + 1] first row of each request
    drafts: np.ndarray  # [R] drafts each request verifies
    sample_mask: np.ndarray  # [R] whether the request samples this step
    sample_rows: np.ndarray  # [S] rows whose logits are sampled
    adapter_of_row: np.ndarray | None = None  # [T] LoRA adapter of each row (0: base); None: none loaded
    images: Any = None  # vision/: the step's image-token rows and their features; None: no image token
    # [T] past the last key position each row sees where a row sees past itself (an image's tokens attending
    # both ways: ``image_both_ways``); None: every row is causal
    key_ends: np.ndarray | None = None
    long_rope: np.ndarray | None = (
        None  # [T] rows rotated with a longrope model's long set (rope.py); None: none
    )

    @property
    def decode_like(self) -> bool:
        """Every row is a single query over its own request's keys: no prompt chunk in the step."""
        return bool(((self.n == 1) | (self.drafts > 0)).all())
