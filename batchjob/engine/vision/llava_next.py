"""LLaVA-NeXT (anyres): each image is resized to the best of the model's grid pinpoints and cut into tiles
of the tower's size, plus the whole image downscaled; the model packs the tiles' features back into the
image's aspect (unpadded) with a newline feature after each row. An image's token count follows from its
size (``image_sizes``), computed with the model's own grid and unpadding functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need
from batchjob.engine.vision.llava import trim_tower
from batchjob.errors import ConfigError


def _anyres():
    # transformers' LLaVA-NeXT modeling module (its grid and unpadding functions): loaded with such a model only
    from transformers.models.llava_next import modeling_llava_next

    return modeling_llava_next


class LlavaNext(Family):
    name = "llava_next"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.feature_layer = trim_tower(model)

    def _tiles(self, size: torch.Tensor) -> int:
        config = self.model.config
        pinpoints = config.image_grid_pinpoints
        return _anyres().image_size_to_num_patches(
            size, grid_pinpoints=pinpoints, patch_size=config.vision_config.image_size
        )

    def _count(self, size: torch.Tensor) -> int:
        """The tokens an image of ``size`` (height, width) takes: the whole image's patches, then the tiles'
        patches unpadded to the image's aspect with one newline a row (one newline alone: a single tile)."""
        config = self.model.config
        side = config.vision_config.image_size // config.vision_config.patch_size
        whole = side * side + (config.vision_feature_select_strategy == "full")
        if self._tiles(size) == 1:
            return whole + 1
        rows, cols = _anyres().get_anyres_image_grid_shape(
            size, config.image_grid_pinpoints, config.vision_config.image_size
        )
        height, width = _anyres().unpad_image(torch.empty(0, rows * side, cols * side), size).shape[1:]
        return whole + height * (width + 1)

    def _images(self, inputs: Inputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per image: its real tiles ``[n, C, H, W]`` (the processor pads to the batch's most) and its size."""
        pixels, sizes = _pixels_and_sizes(inputs)
        return [(p[: self._tiles(s)], s) for p, s in zip(pixels, sizes, strict=True)]

    def check(self, inputs: Inputs) -> str | None:
        """The processor's tiles of each image (the rest is the padding to a batch's most: zeros) against the
        model's grid: a processor whose image_grid_pinpoints differ from the model config's cuts other tiles
        than the model unpacks (too few failed the whole tower call; too many were cut silently)."""
        for i, (pixels, size) in enumerate(zip(*_pixels_and_sizes(inputs), strict=True)):
            made = int((pixels.flatten(1) != 0).any(dim=1).sum())
            if made != self._tiles(size):
                return (
                    f"image {i} ({int(size[0])}x{int(size[1])}): the processor cut {made} tiles where the model's "
                    f"image_grid_pinpoints give {self._tiles(size)}: the folder's preprocessor_config.json and "
                    "config.json disagree on the grid"
                )
        return None

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        if not inputs:
            return [], []
        images = self._images(inputs)
        return [self._count(s) for _, s in images], [digest(p, s) for p, s in images]

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        per_request = [self._images(inputs) for inputs in batch]
        images = [image for request in per_request for image in request]
        pixels = torch.cat([p for p, _ in images]).to(device, dtype)  # [tiles, C, H, W]
        sizes = torch.stack([s for _, s in images]).to(device)
        config = self.model.config
        out = self.model.get_image_features(
            pixel_values=pixels,
            image_sizes=sizes,
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        per_image = list(out.pooler_output)
        features, at = [], 0
        for request in per_request:
            features.append(torch.cat(per_image[at : at + len(request)]))
            at += len(request)
        return features


def _pixels_and_sizes(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = need(inputs, "pixel_values", 5, "LLaVA-NeXT")  # [N, tiles, C, H, W]
    sizes = need(inputs, "image_sizes", 2, "LLaVA-NeXT")  # [N, 2]: height, width
    if len(sizes) != len(pixels):
        raise ConfigError(f"LLaVA-NeXT images: {len(sizes)} image_sizes for {len(pixels)} images")
    return pixels, sizes
