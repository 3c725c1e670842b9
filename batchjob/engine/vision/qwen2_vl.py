"""Qwen2-VL and Qwen2.5-VL: pixel values come as flattened patches with each image's (t, h, w) patch grid
(``image_grid_thw``), an image takes ``t*h*w / merge²`` tokens (it varies with the image's size), and the
language model rotates by 3-D M-RoPE positions: a prompt's come from the model's own ``get_rope_index``
(computed once, at admit), every later token's are its index plus the prompt's ``rope_delta`` in all three.
A request without images has plain positions (the model repeats them 3x itself)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need, per_request
from batchjob.errors import ConfigError


class Qwen2VL(Family):
    name = "qwen2_vl"

    def _grid(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Pixels ``[P, D]``, the grid ``[N, 3]`` and each image's patch count (checked against P)."""
        pixels = need(inputs, "pixel_values", 2, "Qwen2-VL")
        grid = need(inputs, "image_grid_thw", 2, "Qwen2-VL").to(torch.int64)
        patches = grid.prod(-1).tolist()
        if grid.shape[-1] != 3 or sum(patches) != len(pixels):
            raise ConfigError(
                f"Qwen2-VL images: image_grid_thw {grid.tolist()} does not describe the {len(pixels)} patches "
                "of pixel_values"
            )
        return pixels, grid, patches

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        if not inputs:
            return [], []
        pixels, grid, patches = self._grid(inputs)
        merge = self.model.config.vision_config.spatial_merge_size
        cuts = np.cumsum([0, *patches])
        digests = [digest(pixels[a:b], g) for a, b, g in zip(cuts[:-1], cuts[1:], grid, strict=True)]
        return [n // merge**2 for n in patches], digests

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        pixels = torch.cat([inputs["pixel_values"] for inputs in batch]).to(device, dtype)
        grid = torch.cat([inputs["image_grid_thw"] for inputs in batch]).to(device, torch.int64)
        out = self.model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True)
        per_image = list(out.pooler_output)
        return per_request(per_image, [len(inputs["image_grid_thw"]) for inputs in batch])

    def positions(self, ids: np.ndarray, inputs: Inputs) -> tuple[np.ndarray, int] | None:
        if not inputs:
            return None
        input_ids = torch.from_numpy(ids)[None]
        kinds = (input_ids == self.image_token_id).to(torch.int32)  # text 0, image 1 (as the processor marks)
        grid = inputs["image_grid_thw"].to(torch.int64)
        position_ids, delta = self.model.model.get_rope_index(input_ids, kinds, image_grid_thw=grid)
        return position_ids[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0])
