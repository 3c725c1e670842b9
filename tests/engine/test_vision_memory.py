"""The vision tower's memory from its config (vision/memory.py): each family's names read as one shape,
patches counted from the processor's pixel layouts, and the tower call's reserve in the CUDA KV plan."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.vision import memory

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "name, width, mlp, layers, values",
    [
        ("LlavaConfig", 1024, 4096, 24, 3 * 14 * 14),  # CLIP ViT-L/14
        ("Qwen2VLConfig", 1280, 4 * 1280, 32, 3 * 2 * 14 * 14),  # embed_dim, mlp_ratio, depth, temporal
        ("Idefics3Config", 1152, 3072, 12, 3 * 32 * 32),  # SigLIP
    ],
)
def test_each_familys_tower_is_read_from_its_config(name, width, mlp, layers, values):
    import transformers

    tower = memory.Tower.of(getattr(transformers, name)())
    assert (tower.width, tower.mlp, tower.layers, tower.patch_values) == (width, mlp, layers, values)
    assert not tower.eager
    assert tower.encode_bytes(1000, 577, 2) == 1000 * (4 * width + 4 * mlp) * 2  # linear in patches
    assert tower.encode_bytes(2000, 577, 2) == 2 * tower.encode_bytes(1000, 577, 2)


def test_patches_and_sequences_follow_the_pixel_layouts():
    from transformers import LlavaConfig, Qwen2VLConfig

    clip = memory.Tower.of(LlavaConfig())
    pixels = torch.zeros(2, 3, 336, 336)  # LLaVA: [N, C, H, W]
    assert memory.patches(pixels, clip) == 2 * 576 and memory.sequence(pixels, clip) == 576
    tiles = torch.zeros(2, 5, 3, 336, 336)  # LLaVA-NeXT: [N, tiles, C, H, W]
    assert memory.patches(tiles, clip) == 10 * 576 and memory.sequence(tiles, clip) == 576
    qwen = memory.Tower.of(Qwen2VLConfig())
    flat = torch.zeros(1400, 3 * 2 * 14 * 14)  # Qwen2-VL: flattened patches [P, D]
    assert memory.patches(flat, qwen) == 1400 == memory.sequence(flat, qwen)


@pytest.mark.engine
def test_the_kv_plan_keeps_one_tower_call_free(tmp_path):
    """_cuda_reserve (what the CUDA pool sizing holds back) grows by the tower call at the step's budget
    for a vision-language model, and not for a text model."""
    from transformers import AutoModelForImageTextToText

    from batchjob.engine.config import EngineConfig
    from batchjob.engine.kv_cache import _cuda_reserve
    from tests.vision_models import make_llava

    model = AutoModelForImageTextToText.from_pretrained(make_llava(tmp_path / "llava"))
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=256, cuda_graphs=False)
    vocab = model.get_input_embeddings().weight.shape[0]
    logits = 3 * min(256, config.max_num_seqs * (1 + config.num_speculative_tokens)) * vocab * 4
    tower = memory.reserve_bytes(model.config, 256, 4)
    assert tower > 0 and _cuda_reserve(model, config, 0) == logits + tower
