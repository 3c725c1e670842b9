"""(leaf) The vision tower's memory, from its config alone (no torch): how many patches a request's images
are to the tower, the transient memory of one tower call over a number of patches, and the bound on the
patches one call encodes (the step's token budget, at least ``TOWER_CALL_PATCHES``), which the KV plan
reserves memory for.

The estimate of one call over ``P`` patches, ``W`` wide, MLP ``I`` wide, in the dtype's bytes:
``P·(4W + 4I)`` (a layer's residual stream, normed input, attention output, and its MLP's inner buffers with
the activation's temporaries; the layers' outputs are not held), and the attention scores (``heads·P·S``
for sequences of ``S`` patches) only where the tower's attention is eager (SDPA's kernels do not hold
them). ``measurements/vision_memory.py`` measures one encode's peak against it: CLIP ViT-B/16 at 224 px and
ViT-L/14 at 336 (LLaVA's), 1 to 16 images, float32 on the CPU: the estimate is 1.2x the peak, the same
per patch at every count (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tower:
    """A vision tower's shape, read from a vision config under each family's names."""

    width: int  # the tower's hidden size (Qwen2-VL: embed_dim)
    mlp: int  # its MLP's inner width
    layers: int
    heads: int
    patch_values: int  # values a patch is made of: channels x patch_size² (x temporal_patch_size)
    eager: bool  # the attention scores are materialised

    @classmethod
    def of(cls, model_config: Any) -> Tower:
        vision = model_config.vision_config
        width = int(getattr(vision, "embed_dim", None) or vision.hidden_size)
        mlp = getattr(vision, "intermediate_size", None) or int(getattr(vision, "mlp_ratio", 4) * width)
        layers = getattr(vision, "num_hidden_layers", None) or vision.depth
        heads = getattr(vision, "num_attention_heads", None) or vision.num_heads
        channels = next(
            (
                getattr(vision, k)
                for k in ("num_channels", "in_channels", "in_chans")
                if getattr(vision, k, None)
            ),
            3,
        )
        values = (
            int(channels) * int(vision.patch_size) ** 2 * int(getattr(vision, "temporal_patch_size", 1) or 1)
        )
        eager = getattr(vision, "_attn_implementation", None) == "eager"
        return cls(width, int(mlp), int(layers), int(heads), values, eager)

    def encode_bytes(self, patches: int, sequence: int, dtype_bytes: int) -> int:
        """One tower call's transient memory over ``patches`` patches in sequences of ``sequence``."""
        values = patches * (4 * self.width + 4 * self.mlp)
        if self.eager:
            values += self.heads * patches * sequence
        return values * dtype_bytes


def patches(pixel_values: Any, tower: Tower) -> int:
    """The patches a request's pixel values are to the tower (padding tiles and crops included)."""
    return int(pixel_values.numel()) // tower.patch_values


def sequence(pixel_values: Any, tower: Tower) -> int:
    """The patches one attention sequence of the tower holds: an image, tile or crop (``[..., C, H, W]``),
    or for flattened patches (Qwen2-VL, ``[P, D]``) all of them (an upper bound)."""
    shape = tuple(pixel_values.shape)
    if len(shape) >= 4:
        return shape[-1] * shape[-2] * shape[-3] // tower.patch_values
    return patches(pixel_values, tower)


TOWER_CALL_PATCHES = 2048  # the patches one tower call may take under any smaller step budget


def max_patches(max_num_batched_tokens: int) -> int:
    """The patches one tower call encodes at most: the step's token budget, and no fewer than
    ``TOWER_CALL_PATCHES`` (the requests of a step beyond them go in further calls; a request's images are
    never split, so one larger than this goes alone). The floor is for the CPU's budget of 512 tokens (a
    larger model's): a call of one or two images (197 patches each at CLIP B/16) multiplies every weight of
    the tower by too few rows to pay for reading it, 42-44 ms an image against 31-33 in calls of 8 (bf16,
    CPU C, *ad hoc*)."""
    return max(TOWER_CALL_PATCHES, int(max_num_batched_tokens))


def reserve_bytes(model_config: Any, max_num_batched_tokens: int, dtype_bytes: int) -> int:
    """What the KV plan keeps free for the vision tower: one call at ``max_patches``."""
    tower = Tower.of(model_config)
    vision = model_config.vision_config
    size, patch = getattr(vision, "image_size", None), int(vision.patch_size)
    bound = max_patches(max_num_batched_tokens)
    seq = min(bound, (int(size) // patch) ** 2) if isinstance(size, int) else bound
    return tower.encode_bytes(bound, seq, dtype_bytes)
