"""Image rows: a vision-language model's images encoded once per request and laid into the language
model's input embeddings, chunk by chunk.

A request carries its images (``Request.images``, state.py: the processor's image outputs, the positions of
its image tokens). The runner's step layout names the packed rows that hold image tokens
(:meth:`VisionStep.rows`); for a step with any, the runner embeds the step's token ids with the language
model's own embedding and overwrites those rows with the request's image features, then runs the model on
``inputs_embeds`` (:meth:`VisionStep.inputs`). The vision tower runs when a request's first image token is
scheduled, batched over the step's requests, and its projected features stay on the request: a chunk may cut
through an image, a preempted request recomputes from the same features, and decode (text tokens only) is
unchanged. The images' digests root the prefix-cache digests of the blocks holding their tokens
(block_manager.py). A family with its own rotary positions (Qwen2-VL's M-RoPE) gives them for a step that
holds one of its image requests; any other step runs as a text model's.

Family rules live in a module each (llava.py, llava_next.py, qwen2_vl.py, idefics3.py; what the hook asks of
them: base.py), chosen by ``model_type``; another vision-language family is refused by name at load
(family.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchjob.engine.vision.base import Family, Inputs
from batchjob.engine.vision.family import SUPPORTED, check_family, is_vlm, refuse
from batchjob.engine.vision.idefics3 import Idefics3
from batchjob.engine.vision.llava import Llava
from batchjob.engine.vision.llava_next import LlavaNext
from batchjob.engine.vision.qwen2_vl import Qwen2VL
from batchjob.engine.vision.state import Images
from batchjob.errors import ConfigError

__all__ = [
    "FAMILIES",
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

FAMILIES: dict[str, type[Family]] = {
    "llava": Llava,
    "llava_next": LlavaNext,
    "qwen2_vl": Qwen2VL,
    "qwen2_5_vl": Qwen2VL,
    "idefics3": Idefics3,
    "smolvlm": Idefics3,
}


def attn_implementation(model: Any, name: str) -> str | dict[str, str]:
    """What ``set_attn_implementation`` takes to put our attention on the language model alone: the vision
    tower keeps its own (it attends within an image, never through the KV cache)."""
    return {"text_config": name} if is_vlm(model.config) else name


@dataclass
class ImageRows:
    """One step's rows that hold image tokens, and its position ids where a family has its own."""

    rows: np.ndarray  # [M] packed rows of the step, ascending
    parts: list[tuple[Images, int, int]]  # per request in step order: its images, feature rows [a, b)
    rope: np.ndarray | None = None  # [3, T] int64: the step's position ids (M-RoPE); None: plain


def _rope_rows(reqs: Sequence[Any], starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """The step's 3-D position ids when one of its requests has its own (None: every row plain)."""
    if not any(r.images is not None and r.images.rope is not None for r in reqs):
        return None
    cols = []
    for r, s, e in zip(reqs, starts.tolist(), ends.tolist(), strict=True):
        t = np.arange(s, e, dtype=np.int64)
        rope = None if r.images is None else r.images.rope
        if rope is None:
            cols.append(np.broadcast_to(t, (3, e - s)))
            continue
        inside = t < rope.shape[1]
        p = np.empty((3, e - s), dtype=np.int64)
        p[:, inside] = rope[:, t[inside]]
        p[:, ~inside] = t[~inside] + r.images.rope_delta
        cols.append(p)
    return np.concatenate(cols, axis=1)


class VisionStep:
    """The runner's hook for a vision-language model: admits a request's images, names a step's image
    rows, encodes and lays the features into the step's input embeddings."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.family = FAMILIES[model.config.model_type](model)
        self.image_token_id = self.family.image_token_id
        self.encoded_images = 0  # images through the vision tower (counts re-encodings: none expected)

    def admit(self, inputs: Inputs, prompt_ids: Sequence[int]) -> Images:
        """A request's images against its prompt ids; image tokens that are not the images' count is the
        request's error, not an exception."""
        counts, digests = self.family.units(inputs)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id).astype(np.int64)
        images = Images(inputs, positions, np.cumsum([0, *counts]).astype(np.int64), digests)
        if len(positions) != sum(counts):
            each = f"{counts[0]} tokens each" if len(set(counts)) == 1 else f"{counts} tokens"
            images.error = (
                f"the prompt has {len(positions)} image tokens (id {self.image_token_id}) for "
                f"{len(counts)} image(s) of {each if counts else '0 tokens'}: it needs {sum(counts)}"
            )
        else:
            rope = self.family.positions(ids, inputs)
            if rope is not None:
                images.rope, images.rope_delta = rope
        return images

    def rows(
        self, reqs: Sequence[Any], starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray
    ) -> ImageRows | None:
        """The step's image rows (None when it has none and plain positions: the runner passes token ids)."""
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
        rope = _rope_rows(reqs, starts, ends)
        if not parts and rope is None:
            return None
        return ImageRows(np.concatenate(rows) if rows else np.zeros(0, np.int64), parts, rope)

    def inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: ImageRows
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The step's model inputs (token ids, or embeddings with image rows overwritten by their features)
        and position ids (``[1, T]``, or a family's ``[3, 1, T]``)."""
        if step.rope is not None:
            position_ids = torch.from_numpy(step.rope)[:, None].to(self.device)
        if not step.parts:
            return {"input_ids": input_ids}, position_ids
        return {"inputs_embeds": self.embed(input_ids, step)}, position_ids

    def embed(self, input_ids: torch.Tensor, step: ImageRows) -> torch.Tensor:
        """The step's input embeddings ``[1, T, hidden]``: its token ids embedded, image rows overwritten
        by their features (the requests not encoded yet go through the vision tower first, together)."""
        pending = {id(images): images for images, _, _ in step.parts if images.features is None}
        self._encode(list(pending.values()))  # (a prompt's n samples share one Images)
        embeds = self.model.get_input_embeddings()(input_ids)
        features = torch.cat([_features(images)[a:b] for images, a, b in step.parts])
        rows = torch.from_numpy(step.rows).to(self.device)
        embeds[0, rows] = features.to(embeds.dtype)
        return embeds

    def _encode(self, pending: list[Images]) -> None:
        if not pending:
            return
        features = self.family.encode([images.inputs for images in pending], self.device, self.dtype)
        for images, rows in zip(pending, features, strict=True):
            assert rows.shape[0] == len(images.positions), "features and image tokens disagree"
            images.features = rows
            self.encoded_images += images.count


def _features(images: Images) -> torch.Tensor:
    assert images.features is not None, "a step's images are encoded before their rows are laid in"
    return images.features


def _as_inputs(images: Any) -> Inputs:
    """The processor's image outputs as a plain dict (a bare tensor or N tensors: the pixel values); a
    mapping without ``pixel_values`` (a text row's processor outputs) holds no image."""
    if isinstance(images, Mapping):
        if "pixel_values_videos" in images:  # its tokens would be read as text: a wrong answer, not an error
            raise ConfigError("videos (pixel_values_videos) are not supported; images only")
        return {str(k): v for k, v in images.items()} if "pixel_values" in images else {}
    if not isinstance(images, torch.Tensor):
        images = torch.stack(list(images))
    return {"pixel_values": images[None] if images.dim() == 3 else images}


def admit(step: VisionStep | None, images: Any, prompt_ids: Sequence[int]) -> Images | None:
    """A request's images for an engine that may have no vision hook (None: a text request). A prompt with
    image tokens but no images is that request's error (the tokens would be read as text: HF refuses too)."""
    inputs = {} if images is None else _as_inputs(images)
    if not inputs:
        if step is None or step.image_token_id not in prompt_ids:
            return None
        return step.admit({}, prompt_ids)
    if step is None:
        raise ConfigError("this model takes no images (it is not a vision-language model)")
    return step.admit(inputs, prompt_ids)


def attach_to(engine: Any, sharded: bool) -> VisionStep | None:
    """The vision hook of a new engine whose model is a vision-language model (None for a text model)."""
    if not is_vlm(engine.model.config):
        return None
    refuse(engine.config, sharded)
    step = VisionStep(engine.model, engine.device, engine.dtype)
    engine.runner.vision = step
    return step
