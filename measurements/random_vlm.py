"""Write a vision-language model with random weights at a real model's shape, with its processor, for the
image bench.

Nothing can be downloaded here, so the shape is a real one's and the weights are noise. ``--family llava``
(the default): a CLIP ViT-B/16 tower at 224 pixels (196 image tokens, LLaVA's "default" features without
CLS) or ViT-L/14 at 336 (576, LLaVA-1.5's), a two-layer projector, and a SmolLM2-135M- or Qwen2.5-0.5B-shaped
language model (Llama architecture, the default model's tokenizer with an ``<image>`` token; ``--tokenizer
trained`` a small one trained here); its processor resizes and centre-crops every image to the tower's size,
so two sizes of picture differ in preprocessing, not in tokens. ``--family llava_next``: the same tower and
language model under LLaVA-NeXT's anyres tiling, on LLaVA-1.6's grids counted in tiles of the tower's size
(224 px tiles: a square picture of 224 px takes 406 tokens, of 448 px 1,008). ``--family idefics3``:
SmolVLM-256M's shape (SigLIP-B/16 on 512 px crops, pixel shuffle by 4, SmolLM2-135M), pictures resized to
1024 px (2 x 2 crops and the whole: 320 tokens) where SmolVLM resizes to 2048. ``--family gemma3``: Gemma 3's
layout (256 tokens an image, attending both ways; windows of 512 keys in five layers of six) at a small
shape: SigLIP-B/16 at 512 px (1,024 patches pooled by 2) where Gemma 3 has SigLIP-So400m/14 at 896, and
a Gemma 3 language model of SmolLM2-135M's widths.

    python measurements/random_vlm.py /tmp/llava-b16-135m                        # ViT-B/16-224 + 135M
    python measurements/random_vlm.py /tmp/llava-b16-0.5b --text qwen2.5-0.5b
    python measurements/random_vlm.py /tmp/next-b16-135m --family llava_next
    python measurements/random_vlm.py /tmp/idefics3-256m --family idefics3
    python measurements/random_vlm.py /tmp/gemma3-b16-135m --family gemma3
    batchjob bench --model /tmp/llava-b16-135m --image-sizes 224,448 --num-requests 64 --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test suite's builders (tests/), as documented: run from anywhere

VISION = {  # hidden, intermediate, layers, heads, patch, image size
    "b16-224": (768, 3072, 12, 12, 16, 224),
    "l14-336": (1024, 4096, 24, 16, 14, 336),
}
TEXT = {  # hidden, intermediate, layers, heads, KV heads, rope theta
    "smollm2-135m": (576, 1536, 30, 9, 3, 100000.0),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 1000000.0),
}


IDEFICS3_TOKENS = [  # Idefics3's own: the crops' markers and grid positions
    "<fake_token_around_image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
]


def _tokenizer(kind: str, out: Path, extra: list[str]):
    if kind == "trained":
        from tests.tiny_models import make_tokenizer

        tokenizer = make_tokenizer(out, vocab_size=1024)
    else:
        from transformers import AutoTokenizer

        from batchjob.models import resolve_model  # the default model's package

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", *extra]})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _text_config(text: str, tokenizer):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv, theta = TEXT[text]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        rope_theta=theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def _clip_config(vision: str):
    from transformers import CLIPVisionConfig

    v_hidden, v_inter, v_layers, v_heads, patch, size = VISION[vision]
    return CLIPVisionConfig(
        hidden_size=v_hidden,
        intermediate_size=v_inter,
        num_hidden_layers=v_layers,
        num_attention_heads=v_heads,
        patch_size=patch,
        image_size=size,
        projection_dim=512,
    )


def _pinpoints(size: int) -> list[list[int]]:
    """LLaVA-1.6's tiling grids (1x2, 2x1, 2x2, 1x3, 3x1 tiles) in tiles of the tower's size."""
    return [[size * h, size * w] for h, w in ((1, 2), (2, 1), (2, 2), (1, 3), (3, 1))]


def _llava(family: str, vision: str, text: str, tokenizer):
    """LLaVA or LLaVA-NeXT (anyres on LLaVA-1.6's grids) and its processor, both from the same tower."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    from tests.vision_models import VISION_CHAT_TEMPLATE

    patch, size = VISION[vision][4:]
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    parts = {"vision_config": _clip_config(vision), "text_config": _text_config(text, tokenizer)}
    crop = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
    if family == "llava":
        config = LlavaConfig(**parts, image_token_id=image_id)
        model = LlavaForConditionalGeneration(config)
        images, kind = CLIPImageProcessorPil(**crop), LlavaProcessor
    else:
        config = LlavaNextConfig(
            **parts, image_token_id=image_id, image_grid_pinpoints=_pinpoints(size), tie_word_embeddings=True
        )
        model = LlavaNextForConditionalGeneration(config)
        images = LlavaNextImageProcessorPil(**crop, image_grid_pinpoints=_pinpoints(size))
        kind = LlavaNextProcessor
    processor = kind(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    return model, processor


def _idefics3(text: str, tokenizer):
    """Idefics3 at SmolVLM-256M's shape (SigLIP-B/16 on 512-pixel crops, pixel shuffle by 4: 64 tokens a
    crop), every picture resized to 1024 pixels on its longest side: 2 x 2 crops and the whole (320 tokens;
    SmolVLM-256M itself resizes to 2048: 17 crops, too slow to bench on a small CPU)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from tests.vision_models import VISION_CHAT_TEMPLATE

    crop, patch = 512, 16
    vision = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": crop,
        "patch_size": patch,
    }
    config = Idefics3Config(
        vision_config=vision,
        text_config=_text_config(text, tokenizer).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=4,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Idefics3ForConditionalGeneration(config)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * crop}, max_image_size={"longest_edge": crop})
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=(crop // patch) ** 2 // 16,
        chat_template=VISION_CHAT_TEMPLATE.replace("<image>\n", "<image>"),
    )
    return model, processor


def _gemma3(text: str, tokenizer, out: Path):
    """Gemma 3's layout at a small shape (the module's docstring), built by the test suite's builder."""
    from tests.vision_models import gemma3_model

    size = 512
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    vision |= {"image_size": size, "patch_size": 16}
    hidden, inter, layers, heads, kv, _ = TEXT[text]
    language = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=8192,
        sliding_window=512,
    )
    return gemma3_model(tokenizer, out, vision, language, 256, size, 0.02)


TOWERS = {"idefics3": "SigLIP-B/16-512", "gemma3": "SigLIP-B/16-512"}


def build(out: Path, family: str, vision: str, text: str, tokenizer_kind: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    extra = IDEFICS3_TOKENS if family == "idefics3" else []
    tokenizer = _tokenizer(tokenizer_kind, out, extra)
    torch.manual_seed(0)
    if family == "idefics3":
        model, processor = _idefics3(text, tokenizer)
    elif family == "gemma3":
        model, processor, tokenizer = _gemma3(text, tokenizer, out)
    else:
        model, processor = _llava(family, vision, text, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    shape = f"{TOWERS.get(family, vision)} + {text}"
    print(f"{family}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters ({shape}) -> {out}")
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write the model and its processor into")
    ap.add_argument(
        "--family",
        choices=["llava", "llava_next", "idefics3", "gemma3"],
        default="llava",
        help="LLaVA; LLaVA-NeXT (anyres tiles of the tower's size on LLaVA-1.6's grids: an image's tokens "
        "follow its size); Idefics3 at SmolVLM-256M's shape; Gemma 3's layout (these two: --vision not used)",
    )
    ap.add_argument("--vision", choices=list(VISION), default="b16-224", help="the tower's shape (LLaVA's)")
    ap.add_argument("--text", choices=list(TEXT), default="smollm2-135m", help="the language model's shape")
    ap.add_argument(
        "--tokenizer",
        choices=["default", "trained"],
        default="default",
        help="the default model's tokenizer, or a small one trained here (no package needed)",
    )
    args = ap.parse_args()
    build(args.out, args.family, args.vision, args.text, args.tokenizer)
