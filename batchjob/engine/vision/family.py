"""(leaf) Which vision-language families batchjob runs, told from a model's config alone (no torch): the
loader picks the image-text class for them (models.py), the engine's plan refuses the others by name."""

from __future__ import annotations

from typing import Any

from batchjob.errors import ConfigError

# the model_types vision/__init__.py FAMILIES builds
SUPPORTED = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm", "gemma3")
# those whose image tokens attend both ways within an image (the attention feature ``image_both_ways``)
BOTH_WAYS = ("gemma3",)


# Image-text families whose config names no vision tower (``is_vlm`` cannot tell them from a text model):
# Fuyu lays image patches straight into its language model, Chameleon reads an image as VQ tokens.
NO_TOWER = ("fuyu", "chameleon")


def is_vlm(config: Any) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def takes_images(config: Any) -> bool:
    """Whether a model takes images at all: a vision tower's config, a family of ``NO_TOWER``, or a VQ image
    tokenizer's config (``vq_config``: Chameleon, Emu3). What ``--image-column`` is refused by: its family,
    not "not a vision-language model", for one that takes them."""
    return (
        is_vlm(config)
        or getattr(config, "model_type", None) in NO_TOWER
        or getattr(config, "vq_config", None) is not None
    )


def image_both_ways(config: Any) -> str | None:
    """What makes a model's image tokens attend both ways (the attention feature), or None."""
    if is_vlm(config) and config.model_type in BOTH_WAYS:
        return f"{config.model_type}: each image's tokens attend both ways (token_type_ids)"
    return None


def check_family(config: Any, images: bool = False) -> None:
    """Refuse a vision-language family batchjob has not built, naming it; ``images``: for a job with images,
    also a family that takes images without a vision tower's config (``takes_images``; its text runs)."""
    vlm = takes_images(config) if images else is_vlm(config)
    if vlm and config.model_type not in SUPPORTED:
        raise ConfigError(
            f"vision-language model family {config.model_type!r} is not supported yet; "
            f"supported: {', '.join(SUPPORTED)}"
        )


def refuse(config: Any, sharded: bool) -> None:
    """Refuse by name what image rows are not built with: tensor parallelism, a prefill-only task."""
    if sharded:
        raise ConfigError(
            f"vision-language models run without tensor parallelism (tensor_parallel_size="
            f"{config.tensor_parallel_size}, --tensor-parallel-size): the vision tower is not sharded; use 1"
        )
    if config.task != "generate":
        raise ConfigError(
            f"vision-language models with task={config.task!r} are not supported (generate only)"
        )
