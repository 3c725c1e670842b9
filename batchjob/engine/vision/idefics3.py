"""Idefics3 and SmolVLM: the processor splits each image into crops (plus the whole image, downscaled) and
pads a batch's crops with all-zero ones; the model's ``get_image_features`` drops those, runs the tower on
the real crops (``pixel_attention_mask`` marks their padded pixels) and pixel-shuffles each crop's patches
into a fixed number of tokens. An image here is one real crop; positions are plain."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need


class Idefics3(Family):
    name = "idefics3"

    def tokens_per_crop(self, crops: torch.Tensor) -> int:
        """A crop's patches, pixel-shuffled: (height / patch_size) x (width / patch_size) / scale_factor², of
        the processor's crops (its max_image_size), which the tower takes at any size (its position buckets),
        not only at its config's image_size."""
        config = self.model.config
        patch = config.vision_config.patch_size
        return (crops.shape[-2] // patch) * (crops.shape[-1] // patch) // config.scale_factor**2

    def _crops(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The real crops ``[n, C, H, W]`` and their pixel masks ``[n, H, W]`` (all-zero crops: padding)."""
        pixels = need(inputs, "pixel_values", 5, "Idefics3").flatten(0, 1)  # [1, N, C, H, W] -> [N, ...]
        real = (pixels != 0).flatten(1).any(1)
        mask = inputs.get("pixel_attention_mask")
        if mask is not None:
            mask = need(inputs, "pixel_attention_mask", 4, "Idefics3").flatten(0, 1)[real]
        return pixels[real], mask

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        if not inputs:
            return [], []
        crops, masks = self._crops(inputs)
        if masks is None:
            return [self.tokens_per_crop(crops)] * len(crops), [digest(c) for c in crops]
        digests = [digest(c, m) for c, m in zip(crops, masks, strict=True)]
        return [self.tokens_per_crop(crops)] * len(crops), digests

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        parts = [self._crops(inputs) for inputs in batch]
        pixels = torch.cat([c for c, _ in parts])[None].to(device, dtype)  # one sample of every real crop
        masks = None
        if all(m is not None for _, m in parts):
            masks = torch.cat([m for _, m in parts if m is not None])[None].to(device)
        out = self.model.get_image_features(pixel_values=pixels, pixel_attention_mask=masks, return_dict=True)
        (rows,) = out.pooler_output  # [crops * tokens, hidden]
        return list(rows.split([len(c) * self.tokens_per_crop(c) for c, _ in parts]))
