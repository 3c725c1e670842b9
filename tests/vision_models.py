"""A tiny random LLaVA (CLIP vision tower, Llama language model) with its processor, saved to a folder and
loaded the normal way (``from_pretrained``); and a few generated images. No downloads: the tokenizer is
:func:`tests.tiny_models.make_tokenizer`'s with an ``<image>`` token added."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tests.tiny_models import make_tokenizer

IMAGE_SIZE = 16  # pixels a side after preprocessing
PATCH = 4  # CLIP patch size: (16 / 4)^2 = 16 image tokens an image
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2

# The processor's chat template: a user message's content is a list of {"type": "image"} and
# {"type": "text", "text": ...} parts, rendered as LLaVA's templates render them.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_llava(folder: Path, seed: int = 0) -> Path:
    """Build a tiny random LLaVA and its processor, save both to ``folder``."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_id)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # make the image features loud enough to move the answer
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(str(folder))
    return folder


def make_image(seed: int, size: tuple[int, int] = (24, 20)):
    """A random RGB Pillow image."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(seed: int, size: tuple[int, int] = (24, 20)) -> bytes:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()
