"""Image rows: a vision-language model's images encoded once per request and laid into the language
model's input embeddings, chunk by chunk.

A request carries its images (``Request.images``, state.py: pixel values, the positions of its image
tokens). The runner's step layout names the packed rows that hold image tokens (:meth:`VisionStep.rows`);
for a step with any, the runner embeds the step's token ids with the language model's own embedding and
overwrites those rows with the request's image features (:meth:`VisionStep.embed`), then runs the model
on ``inputs_embeds``. The vision tower runs when a request's first image token is scheduled, batched over
the step's requests, and its projected features stay on the request: a chunk may cut through an image,
a preempted request recomputes from the same features, and decode (text tokens only) is unchanged. The
images' digests root the prefix-cache digests of the blocks holding their tokens (block_manager.py).

Family rules live here, by ``model_type``: only LLaVA is built; another vision-language family is refused
by name at load (:func:`check_family`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchjob.engine.vision.family import SUPPORTED, check_family, is_vlm, refuse
from batchjob.engine.vision.state import Images
from batchjob.errors import ConfigError

__all__ = [
    "SUPPORTED",
    "Images",
    "VisionStep",
    "admit",
    "attach_to",
    "attn_implementation",
    "check_family",
    "is_vlm",
    "refuse",
]


def attn_implementation(model: Any, name: str) -> str | dict[str, str]:
    """What ``set_attn_implementation`` takes to put our attention on the language model alone: the vision
    tower keeps its own (it attends within an image, never through the KV cache)."""
    return {"text_config": name} if is_vlm(model.config) else name


def _tokens_per_image(config: Any) -> int:
    """LLaVA: one token a patch, the CLS token too when the features keep it ("full")."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (config.vision_feature_select_strategy == "full")


def digest(pixels: torch.Tensor) -> bytes:
    """An image's digest: its pixel values' bytes."""
    data = pixels.detach().to("cpu").contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class ImageRows:
    """One step's rows that hold image tokens."""

    rows: np.ndarray  # [M] packed rows of the step, ascending
    parts: list[tuple[Images, int, int]]  # per request in step order: its images, feature rows [a, b)


class VisionStep:
    """The runner's hook for a vision-language model: admits a request's images, names a step's image
    rows, encodes and lays the features into the step's input embeddings."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.image_token_id = int(model.config.image_token_id)
        self.tokens_per_image = _tokens_per_image(model.config)
        self.encoded_images = 0  # images through the vision tower (counts re-encodings: none expected)

    def admit(self, pixel_values: torch.Tensor | Sequence[torch.Tensor], prompt_ids: Sequence[int]) -> Images:
        """A request's images (``[N, C, H, W]``, or N tensors ``[C, H, W]``) against its prompt ids; a
        count of image tokens that is not N times an image's is the request's error, not an exception."""
        if not isinstance(pixel_values, torch.Tensor):
            pixel_values = torch.stack(list(pixel_values))
        if pixel_values.dim() == 3:
            pixel_values = pixel_values[None]
        if pixel_values.dim() != 4:
            raise ConfigError(
                f"images must be pixel values [N, C, H, W], got shape {tuple(pixel_values.shape)}"
            )
        ids = np.asarray(prompt_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id).astype(np.int64)
        n, k = len(pixel_values), self.tokens_per_image
        error = None
        if len(positions) != n * k:
            error = (
                f"the prompt has {len(positions)} image tokens (id {self.image_token_id}) for {n} image(s) "
                f"of {k} tokens each: it needs {n * k}"
            )
        return Images(pixel_values, positions, k, [digest(p) for p in pixel_values], error)

    def rows(self, reqs: Sequence[Any], starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray):
        """The step's image rows (None when the step has none: the runner then passes token ids)."""
        rows, parts = [], []
        for i, req in enumerate(reqs):
            images = req.images
            if images is None:
                continue
            a, b = np.searchsorted(images.positions, [starts[i], ends[i]])
            if a == b:
                continue
            rows.append(images.positions[a:b] - starts[i] + offsets[i])
            parts.append((images, int(a), int(b)))
        if not parts:
            return None
        return ImageRows(np.concatenate(rows), parts)

    def embed(self, input_ids: torch.Tensor, step: ImageRows) -> torch.Tensor:
        """The step's input embeddings ``[1, T, hidden]``: its token ids embedded, image rows overwritten
        by their features (the requests not encoded yet go through the vision tower first, together)."""
        self._encode([images for images, _, _ in step.parts if images.features is None])
        embeds = self.model.get_input_embeddings()(input_ids)
        features = torch.cat([_features(images)[a:b] for images, a, b in step.parts])
        rows = torch.from_numpy(step.rows).to(self.device)
        embeds[0, rows] = features.to(embeds.dtype)
        return embeds

    def _encode(self, pending: list[Images]) -> None:
        if not pending:
            return
        pixels = torch.cat([images.pixel_values for images in pending]).to(self.device, self.dtype)
        out = self.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        per_image = list(out)
        self.encoded_images += len(per_image)
        at = 0
        for images in pending:
            n = len(images.pixel_values)
            images.features = torch.cat(per_image[at : at + n])
            at += n
            assert images.features.shape[0] == len(images.positions), "features and image tokens disagree"


def _features(images: Images) -> torch.Tensor:
    assert images.features is not None, "a step's images are encoded before their rows are laid in"
    return images.features


def admit(step: VisionStep | None, images: Any, prompt_ids: Sequence[int]) -> Images | None:
    """A request's images for an engine that may have no vision hook (None: a text request). A prompt with
    image tokens but no images is that request's error (the tokens would be read as text: HF refuses too)."""
    if images is None:
        if step is None or step.image_token_id not in prompt_ids:
            return None
        images = torch.empty((0, 3, 1, 1))
    if step is None:
        raise ConfigError("this model takes no images (it is not a vision-language model)")
    if isinstance(images, Mapping):  # the processor's image outputs (BatchFeature): LLaVA needs the pixels only
        if "pixel_values" not in images:
            raise ConfigError(f"images given as a mapping need 'pixel_values'; got {sorted(images)}")
        images = images["pixel_values"]
    return step.admit(images, prompt_ids)


def attach_to(engine: Any, sharded: bool) -> VisionStep | None:
    """The vision hook of a new engine whose model is a vision-language model (None for a text model)."""
    if not is_vlm(engine.model.config):
        return None
    refuse(engine.config, sharded)
    step = VisionStep(engine.model, engine.device, engine.dtype)
    engine.runner.vision = step
    return step
