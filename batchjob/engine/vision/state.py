"""(leaf) Images: what an image request carries through the engine, and the prefix-cache bytes of a block.

Imports nothing of the engine, so ``request.py`` can name it. The processor's image outputs stay where the
caller made them (host memory) until the request's first step with image tokens encodes them
(vision/__init__.py); the features are then kept on the request for its whole life, so chunked prefill and
a recompute after preemption slice the same rows. An image here is what its family encodes as one unit
(an image; for Idefics3 one crop of a split image), and units may take different numbers of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class Images:
    """A request's images, in prompt order."""

    inputs: dict[str, torch.Tensor]  # the processor's image outputs for this request (host memory)
    positions: np.ndarray  # [M] int64: the prompt positions of the image tokens, ascending
    offsets: np.ndarray  # [N + 1] int64: image i's tokens are positions[offsets[i] : offsets[i + 1]]
    digests: list[bytes]  # per image: a digest of its inputs (the prefix cache's key)
    error: str | None = None  # why the request cannot run (its image tokens and images disagree)
    features: torch.Tensor | None = None  # [M, hidden] on the device, once encoded
    # A family with its own positions (Qwen2-VL's M-RoPE): the prompt's position ids [3, L] and the shift of
    # every later token's (position t + delta in all three); None: plain positions.
    rope: np.ndarray | None = None
    rope_delta: int = 0
    # A family whose image tokens attend both ways (Gemma 3): [K, 2] int64 the first and past-the-last prompt
    # position of each run of image tokens; None: they attend causally, as text does.
    runs: np.ndarray | None = None

    @property
    def count(self) -> int:
        """The number of images."""
        return len(self.digests)

    def block_bytes(self, lo: int, hi: int) -> bytes:
        """The digests of the images with a token in positions [lo, hi): folded into that block's digest,
        so a block holding image tokens is found again only under the same images."""
        a, b = np.searchsorted(self.positions, [lo, hi])
        if a == b:
            return b""
        first = int(np.searchsorted(self.offsets, a, side="right")) - 1
        last = int(np.searchsorted(self.offsets, b - 1, side="right")) - 1
        return b"".join(self.digests[first : last + 1])

    def key_ends(self, lo: int, hi: int) -> np.ndarray:
        """[hi - lo] int64: past the last key each of positions [lo, hi) sees: its run's end for an image
        token that attends both ways, the next position for any other."""
        ends = np.arange(lo + 1, hi + 1, dtype=np.int64)
        for a, b in [] if self.runs is None else self.runs.tolist():
            if a < hi and b > lo:
                ends[max(a, lo) - lo : min(b, hi) - lo] = b
        return ends

    def cut(self, lo: int, hi: int) -> int:
        """The end of a chunk of positions [lo, hi) moved back so that it does not end inside a run: to the
        run's start, or to ``lo`` (no chunk: the rest of the run waits for a step with room for it whole)."""
        if self.runs is None:
            return hi
        i = int(np.searchsorted(self.runs[:, 0], hi, side="left")) - 1  # the last run starting before hi
        if i < 0 or self.runs[i, 1] <= hi:
            return hi
        return max(lo, int(self.runs[i, 0]))


def runs_of(positions: np.ndarray) -> np.ndarray:
    """[K, 2] the first and past-the-last position of each run of consecutive positions."""
    if not len(positions):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate([[0], breaks])]
    ends = positions[np.concatenate([breaks - 1, [len(positions) - 1]])] + 1
    return np.stack([starts, ends], axis=1).astype(np.int64)
