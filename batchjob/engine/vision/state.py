"""(leaf) Images: what an image request carries through the engine, and the prefix-cache bytes of a block.

Imports nothing of the engine, so ``request.py`` can name it. The pixels stay where the caller made them
(host memory) until the request's first step with image tokens encodes them (vision/__init__.py); the
features are then kept on the request for its whole life, so chunked prefill and a recompute after
preemption slice the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class Images:
    """A request's images, in prompt order."""

    pixel_values: torch.Tensor  # [N, C, H, W] as the processor made them (host memory)
    positions: np.ndarray  # [N * k] int64: the prompt positions of the image tokens, ascending
    tokens_per_image: int  # k: the image tokens (and feature rows) one image takes
    digests: list[bytes]  # per image: a digest of its pixel values (the prefix cache's key)
    error: str | None = None  # why the request cannot run (its image tokens and images disagree)
    features: torch.Tensor | None = None  # [N * k, hidden] on the device, once encoded

    def block_bytes(self, lo: int, hi: int) -> bytes:
        """The digests of the images with a token in positions [lo, hi): folded into that block's digest,
        so a block holding image tokens is found again only under the same images."""
        a, b = np.searchsorted(self.positions, [lo, hi])
        if a == b:
            return b""
        k = self.tokens_per_image
        return b"".join(self.digests[a // k : (b - 1) // k + 1])
