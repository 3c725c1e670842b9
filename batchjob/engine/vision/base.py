"""What the vision hook (vision/__init__.py) asks a vision-language family: how many image tokens each of
a request's images takes (from the processor's image outputs), how a batch of requests' images becomes
feature rows, for a family with its own rotary positions a prompt's position ids, and whether its image
tokens attend both ways. One module a family (llava.py, qwen2_vl.py, idefics3.py, gemma3.py); the engine
core names none of them."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchjob.engine.vision.family import image_both_ways
from batchjob.errors import ConfigError

Inputs = dict[str, torch.Tensor]  # one request's image outputs of the processor (pixel_values + extras)


def digest(*tensors: torch.Tensor) -> bytes:
    """A digest of tensors' shapes and bytes (an image's key in the prefix cache)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        data = t.detach().to("cpu").contiguous()
        h.update(repr((tuple(data.shape), str(data.dtype))).encode())
        h.update(data.numpy().tobytes())
    return h.digest()


def per_request(per_image: Sequence[torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """A batch's per-image features regrouped per request (``counts``: each request's images, in order), each
    request's rows concatenated."""
    out, at = [], 0
    for n in counts:
        out.append(torch.cat(list(per_image[at : at + n])))
        at += n
    return out


def need(inputs: Inputs, key: str, dims: int, family: str) -> torch.Tensor:
    """``inputs[key]``, a tensor of ``dims`` dimensions, or a ConfigError naming the key and the shape."""
    value = inputs.get(key)
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"{family} images need {key!r} as a {dims}-d tensor (the processor's), got {got}")
    return value


class Family:
    """A vision-language family's rules (subclasses: one a family). ``model``: the loaded image-text model."""

    name = ""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.image_token_id = int(model.config.image_token_id)
        # Its image tokens attend both ways within each run of them (Gemma 3), not causally: the step's rows
        # in a run see the keys to the run's end, and a chunk may not end inside a run. Read from the one
        # list the attention backend's choice reads too (family.BOTH_WAYS), so the two cannot disagree.
        self.both_ways = image_both_ways(model.config) is not None

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        """Per image of one request (in prompt order): its number of image tokens and its digest."""
        raise NotImplementedError

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per request of ``batch`` (one vision-tower call for all): its feature rows ``[tokens, hidden]``."""
        raise NotImplementedError

    def check(self, inputs: Inputs) -> str | None:
        """Why a request's images are not what the model reads (the request's error), or None."""
        return None

    def positions(self, ids: np.ndarray, inputs: Inputs) -> tuple[np.ndarray, int] | None:
        """A prompt's own position ids ``[3, L]`` and the shift of every later token, or None (plain)."""
        return None
