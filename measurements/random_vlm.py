"""Write a LLaVA with random weights at a real model's shape, with its processor, for the image bench.

Nothing can be downloaded here, so the shape is a real one's and the weights are noise: a CLIP ViT-B/16
tower at 224 pixels (196 image tokens, LLaVA's "default" features without CLS) or ViT-L/14 at 336 (576,
LLaVA-1.5's), a two-layer projector, and a SmolLM2-135M- or Qwen2.5-0.5B-shaped language model (Llama
architecture, the default model's tokenizer with an ``<image>`` token; ``--tokenizer trained`` a small one
trained here). The processor resizes and centre-crops every image to the tower's size, so two sizes of
picture differ in preprocessing, not in tokens.

    python measurements/random_vlm.py /tmp/llava-b16-135m                        # ViT-B/16-224 + 135M
    python measurements/random_vlm.py /tmp/llava-b16-0.5b --text qwen2.5-0.5b
    batchjob bench --model /tmp/llava-b16-135m --image-sizes 224,448 --num-requests 64 --device cpu
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VISION = {  # hidden, intermediate, layers, heads, patch, image size
    "b16-224": (768, 3072, 12, 12, 16, 224),
    "l14-336": (1024, 4096, 24, 16, 14, 336),
}
TEXT = {  # hidden, intermediate, layers, heads, KV heads, rope theta
    "smollm2-135m": (576, 1536, 30, 9, 3, 100000.0),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 1000000.0),
}


def _tokenizer(kind: str, out: Path):
    if kind == "trained":
        from tests.tiny_models import make_tokenizer  # the repository root on the path (PYTHONPATH)

        tokenizer = make_tokenizer(out, vocab_size=1024)
    else:
        from transformers import AutoTokenizer

        from batchjob.models import resolve_model  # the default model's package

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build(out: Path, vision: str, text: str, tokenizer_kind: str) -> None:
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from tests.vision_models import VISION_CHAT_TEMPLATE

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(tokenizer_kind, out)
    v_hidden, v_inter, v_layers, v_heads, patch, size = VISION[vision]
    hidden, inter, layers, heads, kv, theta = TEXT[text]
    vision_config = CLIPVisionConfig(
        hidden_size=v_hidden,
        intermediate_size=v_inter,
        num_hidden_layers=v_layers,
        num_attention_heads=v_heads,
        patch_size=patch,
        image_size=size,
        projection_dim=512,
    )
    text_config = LlamaConfig(
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
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_id=image_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters ({vision} + {text}) -> {out}")
    model.save_pretrained(str(out))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(str(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write the model and its processor into")
    ap.add_argument("--vision", choices=list(VISION), default="b16-224", help="the tower's shape")
    ap.add_argument("--text", choices=list(TEXT), default="smollm2-135m", help="the language model's shape")
    ap.add_argument(
        "--tokenizer",
        choices=["default", "trained"],
        default="default",
        help="the default model's tokenizer, or a small one trained here (no package needed)",
    )
    args = ap.parse_args()
    build(args.out, args.vision, args.text, args.tokenizer)
