"""LLaVA: a CLIP-like tower's patch features projected into the language model; every image (resized to
the tower's size) takes the same number of tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need, per_request


def trim_tower(model: Any) -> int | list[int]:
    """Drop the vision tower's layers past the last one whose output the features read (LLaVA's default is
    the penultimate layer's: the tower's last layer would run for nothing, 1/12 of CLIP B/16's work, as vLLM
    also leaves out at load), and return the ``vision_feature_layer`` that names the same outputs, counted
    from the front (transformers resolves an index from the end with the config's layer count, which the
    shorter tower no longer has). A tower without an ``encoder.layers`` list is left whole."""
    layer = model.config.vision_feature_layer
    tower = model.model.vision_tower
    layers = getattr(getattr(getattr(tower, "vision_model", tower), "encoder", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return layer
    n = len(layers)
    at = [i % (n + 1) for i in ([layer] if isinstance(layer, int) else layer)]  # 0: the embeddings' output
    del layers[max(at) :]
    return at[0] if isinstance(layer, int) else at


class Llava(Family):
    name = "llava"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.feature_layer = trim_tower(model)

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
        out = self.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=self.feature_layer, return_dict=True
        )
        per_image = list(out.pooler_output)
        return per_request(per_image, [len(inputs["pixel_values"]) for inputs in batch])
