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
