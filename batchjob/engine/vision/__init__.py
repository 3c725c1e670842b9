"""Image rows: a vision-language model's images encoded once per request and laid into the language
model's input embeddings, chunk by chunk.

A request carries its images (``Request.images``, state.py: the processor's image outputs, the positions of
its image tokens). The runner's step layout names the packed rows that hold image tokens
(:meth:`VisionStep.rows`); for a step with any, the runner embeds the step's token ids with the language
model's own embedding and overwrites those rows with the request's image features, then runs the model on
``inputs_embeds`` (:meth:`VisionStep.inputs`). The vision tower runs when a request's first image token is
scheduled, batched over the step's requests and, while the call has room, the next requests' images (the
queues' order; not those the prefix cache will serve), and the projected features stay on each request: a chunk may cut
through an image, a preempted request recomputes from the same features, and decode (text tokens only) is
unchanged. The images' digests root the prefix-cache digests of the blocks holding their tokens
(block_manager.py). A family with its own rotary positions (Qwen2-VL's M-RoPE) gives them for a step that
holds one of its image requests; any other step runs as a text model's. A family whose image tokens attend
both ways (Gemma 3) gives each step's rows the keys they see (``key_ends``: an image token sees its image
to the end), and its chunks never end inside an image (:class:`WholeImages`), so a chunk holds the rest of
an image with every key its tokens see.

Family rules live in a module each (llava.py, llava_next.py, qwen2_vl.py, idefics3.py, gemma3.py; what the
hook asks of them: base.py), chosen by ``model_type``; another vision-language family is refused by name at
load (family.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchjob.engine.attention.layout import ramps
from batchjob.engine.block_manager import BlockManager
from batchjob.engine.request import Request
from batchjob.engine.scheduler import ChunkPolicy
from batchjob.engine.vision import memory
from batchjob.engine.vision.base import Family, Inputs
from batchjob.engine.vision.family import SUPPORTED, check_family, is_vlm, refuse
from batchjob.engine.vision.gemma3 import Gemma3
from batchjob.engine.vision.idefics3 import Idefics3
from batchjob.engine.vision.llava import Llava
from batchjob.engine.vision.llava_next import LlavaNext
from batchjob.engine.vision.qwen2_vl import Qwen2VL
from batchjob.engine.vision.state import Images, runs_of
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
    "gemma3": Gemma3,
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
    # [T] int64: past the last key each row sees (a family's image tokens both ways); None: causal
    key_ends: np.ndarray | None = None


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


def _key_ends(reqs: Sequence[Any], starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """[T] past the last key each row of the step sees, where one of them sees past itself; None: causal."""
    cols = [
        np.arange(s + 1, e + 1, dtype=np.int64) if r.images is None else r.images.key_ends(s, e)
        for r, s, e in zip(reqs, starts.tolist(), ends.tolist(), strict=True)
    ]
    key_ends = np.concatenate(cols)
    n = ends - starts
    causal = np.repeat(starts, n) + ramps(n) + 1
    return key_ends if (key_ends != causal).any() else None


class WholeImages(ChunkPolicy):
    """The chunks of a family whose image tokens attend both ways: as much as the budget takes, but never
    ending inside an image (before it, or none this step when the rest of it does not fit)."""

    def chunk(self, req: Request, computed: int, budget: int, block_manager: BlockManager) -> int:
        n = super().chunk(req, computed, budget, block_manager)
        return n if req.images is None else req.images.cut(computed, computed + n) - computed


class VisionStep:
    """The runner's hook for a vision-language model: admits a request's images, names a step's image
    rows, encodes and lays the features into the step's input embeddings."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_patches: int,
        step_tokens: int,
        upcoming: Callable[[], Iterable[Images]] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.family = FAMILIES[model.config.model_type](model)
        self.image_token_id = self.family.image_token_id
        self.encoded_images = 0  # images through the vision tower (counts re-encodings: none expected)
        self.tower = memory.Tower.of(model.config)
        self.max_patches = max_patches  # one tower call's patches at most (memory.py; a request whole)
        self.tower_calls = 0
        # The images the next steps will need encoded, in about the order they come (the engine's queues):
        # a call with room left takes them too, so the tower runs in calls of several images.
        self.upcoming = upcoming
        self.step_tokens = step_tokens  # a step's token budget: an image attended both ways fits it whole

    def admit(self, inputs: Inputs, prompt_ids: Sequence[int]) -> Images:
        """A request's images against its prompt ids; image tokens that are not the images' count is the
        request's error, not an exception."""
        counts, digests = self.family.units(inputs)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id).astype(np.int64)
        images = Images(inputs, positions, np.cumsum([0, *counts]).astype(np.int64), digests)
        images.error = self.family.check(inputs)
        if images.error is not None:
            return images
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
            if self.family.both_ways:
                images.runs = runs_of(positions)
                images.error = self._too_long(images.runs)
        return images

    def _too_long(self, runs: np.ndarray) -> str | None:
        """Why a request's image cannot run: its tokens, attended both ways, are one step's and the budget
        is smaller (None: they fit)."""
        longest = int((runs[:, 1] - runs[:, 0]).max(initial=0))
        if longest <= self.step_tokens:
            return None
        return (
            f"an image of {longest} tokens attends both ways ({self.family.name}), so it is computed in one "
            f"step: max_num_batched_tokens (--max-num-batched-tokens) must be at least {longest}, not "
            f"{self.step_tokens}"
        )

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
        key_ends = _key_ends(reqs, starts, ends) if self.family.both_ways and parts else None
        return ImageRows(np.concatenate(rows) if rows else np.zeros(0, np.int64), parts, rope, key_ends)

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
        if pending:  # (a prompt's n samples share one Images)
            self._encode(self._fill(list(pending.values())))
        embeds = self.model.get_input_embeddings()(input_ids)
        features = torch.cat([_features(images)[a:b] for images, a, b in step.parts])
        rows = torch.from_numpy(step.rows).to(self.device)
        embeds[0, rows] = features.to(embeds.dtype)
        return embeds

    def _encode(self, pending: list[Images]) -> None:
        for batch in self._calls(pending):
            features = self.family.encode([images.inputs for images in batch], self.device, self.dtype)
            self.tower_calls += 1
            for images, rows in zip(batch, features, strict=True):
                assert rows.shape[0] == len(images.positions), "features and image tokens disagree"
                images.features = rows
                self.encoded_images += images.count

    def _fill(self, pending: list[Images]) -> list[Images]:
        """The step's images to encode and, while one call has room (``max_patches``), the upcoming ones
        that are not encoded yet, in order (the first that does not fit ends the search)."""
        size = sum(self._patches(images) for images in pending)
        if self.upcoming is None or size >= self.max_patches:
            return pending
        taken = {id(images) for images in pending}
        for images in self.upcoming():
            if id(images) in taken or images.features is not None:
                continue
            size += self._patches(images)
            if size > self.max_patches:
                break
            taken.add(id(images))
            pending.append(images)
        return pending

    def _patches(self, images: Images) -> int:
        pixels = images.inputs.get("pixel_values")
        return 0 if pixels is None else memory.patches(pixels, self.tower)

    def _calls(self, pending: list[Images]) -> list[list[Images]]:
        """The requests to encode, in order, cut into tower calls of at most ``max_patches`` patches (a
        request's images are one call's, alone when they are more)."""
        calls: list[list[Images]] = []
        size = 0
        for images in pending:
            n = self._patches(images)
            if not calls or size + n > self.max_patches:
                calls.append([])
                size = 0
            calls[-1].append(images)
            size += n
        return calls


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
    budget = engine.config.max_num_batched_tokens
    bound = memory.max_patches(budget)
    step = VisionStep(engine.model, engine.device, engine.dtype, bound, budget, lambda: _upcoming(engine))
    engine.runner.vision = step
    if step.family.both_ways:
        engine.scheduler.chunks = WholeImages()
    return step


def _upcoming(engine: Any) -> Iterator[Images]:
    """The images of the engine's requests that a later step will encode: the running ones' whose prompt
    is not computed past its last image token, then the waiting ones', in queue order, unless the prefix
    cache holds (or a running request is computing) the block with that token: such a request takes the
    blocks, not the features."""
    scheduler, blocks = engine.scheduler, engine.block_manager
    for req in itertools.chain(scheduler.running, scheduler.waiting):
        images = req.images
        if images is None or images.error is not None or images.features is not None or not images.count:
            continue
        last = int(images.positions[-1])
        if req.num_computed_tokens > last or blocks.holds(req, last):
            continue
        yield images
