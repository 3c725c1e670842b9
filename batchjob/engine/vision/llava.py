"""LLaVA: a CLIP-like tower's patch features projected into the language model; every image (resized to
the tower's size) takes the same number of tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need, per_request


class Llava(Family):
    name = "llava"

    def tokens_per_image(self) -> int:
        """One token a patch, the CLS token too when the features keep it ("full")."""
        config = self.model.config
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (config.vision_feature_select_strategy == "full")

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        if not inputs:
            return [], []
        pixels = need(inputs, "pixel_values", 4, "LLaVA")  # [N, C, H, W]
        return [self.tokens_per_image()] * len(pixels), [digest(p) for p in pixels]

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        pixels = torch.cat([inputs["pixel_values"] for inputs in batch]).to(device, dtype)
        per_image = list(self.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output)
        return per_request(per_image, [len(inputs["pixel_values"]) for inputs in batch])
