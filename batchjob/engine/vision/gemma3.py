"""Gemma 3: a SigLIP tower's patches average-pooled to a fixed number of tokens an image
(``mm_tokens_per_image``) and projected; positions are plain. Its image tokens attend both ways within their
image (the model's ``token_type_ids`` mask: each run of image tokens is one block, causal around it): it is
in family.py's BOTH_WAYS, so the step's rows inside a run see the keys to the run's end, and a chunk never
ends inside one (vision/__init__.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchjob.engine.vision.base import Family, Inputs, digest, need, per_request


class Gemma3(Family):
    name = "gemma3"

    def units(self, inputs: Inputs) -> tuple[list[int], list[bytes]]:
        if not inputs:
            return [], []
        pixels = need(inputs, "pixel_values", 4, "Gemma 3")  # [N, C, H, W]: images (and pan-and-scan crops)
        return [int(self.model.config.mm_tokens_per_image)] * len(pixels), [digest(p) for p in pixels]

    def encode(self, batch: Sequence[Inputs], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        pixels = torch.cat([inputs["pixel_values"] for inputs in batch]).to(device, dtype)
        out = self.model.get_image_features(pixel_values=pixels, return_dict=True)
        return per_request(list(out.pooler_output), [len(inputs["pixel_values"]) for inputs in batch])
