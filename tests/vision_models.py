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


def _clip_llama(tokenizer, **text_extra):
    """The tiny CLIP vision tower and Llama language model the LLaVA builders share."""
    from transformers import CLIPVisionConfig, LlamaConfig

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
        **text_extra,
    )
    return vision, text


def make_llava(folder: Path, seed: int = 0) -> Path:
    """Build a tiny random LLaVA and its processor, save both to ``folder``."""
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vision, text = _clip_llama(tokenizer, tie_word_embeddings=False)
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


def hf_label_logprob(hf, inputs, label: list[int]) -> float:
    """log P(label | prompt) from one float64 forward of a Hugging Face model on the processor's inputs (its
    images included) followed by the label's tokens: the sum of each label token's log-probability."""
    n = inputs["input_ids"].shape[1]
    kwargs = {k: v.double() if v.is_floating_point() else v for k, v in dict(inputs).items()}
    kwargs["input_ids"] = torch.cat([kwargs["input_ids"], torch.tensor([label])], 1)
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    for name in ("token_type_ids", "mm_token_type_ids"):  # the label's tokens are text
        if name in kwargs:
            kwargs[name] = torch.nn.functional.pad(kwargs[name], (0, len(label)))
    with torch.inference_mode():
        lp = hf(**kwargs).logits[0].log_softmax(-1)
    return sum(lp[n - 1 + j, t].item() for j, t in enumerate(label))


# Qwen2-VL's chat template renders an image as its start, pad and end tokens; the processor repeats the pad
# token once per merged patch of that image.
QWEN_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_PATCH, QWEN_MERGE = 4, 2  # an image of h x w pixels takes (h / 4) * (w / 4) / 4 tokens
QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _qwen_configs(variant: str, ids: dict[str, int], vocab: int, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        # head_dim 16: 8 rotary frequencies split among time, height and width
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "depth": 2,
        "num_heads": 4,
        "patch_size": QWEN_PATCH,
        "spatial_merge_size": QWEN_MERGE,
        "temporal_patch_size": 2,
    }
    if variant == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        return Qwen2VLConfig(vision_config=vision, text_config=text, **ids)
    # Qwen2.5-VL: windowed attention in block 0 (windows of 2x2 merged patches), full in block 1
    vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "window_size": 16}
    vision["fullatt_block_indexes"] = [1]
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids)


def make_qwen2_vl(folder: Path, variant: str = "qwen2_vl", seed: int = 0) -> Path:
    """Build a tiny random Qwen2-VL (or ``variant="qwen2_5_vl"``: Qwen2.5-VL) and its processor, save both."""
    from transformers import AutoModelForImageTextToText

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL})
    start, end, image, video = tokenizer.convert_tokens_to_ids(QWEN_SPECIAL)
    ids = {
        "image_token_id": image,
        "video_token_id": video,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
    }
    config = _qwen_configs(variant, ids, len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # make the image features loud enough to move the answer
        model.model.visual.merger.mlp[-1].weight.mul_(4.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    _qwen_image_processor().save_pretrained(str(folder))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


def _qwen_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},  # pixels an image keeps, at least / most
    )


class QwenProcessor:
    """What ``Qwen2VLProcessor`` makes of a chat with images: its image processor's patches and grids, the
    rendered prompt with each image's pad token repeated once per merged patch, ``mm_token_type_ids``.
    (``Qwen2VLProcessor`` itself needs torchvision for its video half, and torchvision is not installed.)"""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.image_processor = _qwen_image_processor()

    def __call__(self, images: list, text: str):
        from transformers import BatchFeature

        messages = [
            {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}
        ]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        data = {}
        if images:
            data = dict(self.image_processor(images=images, return_tensors="pt"))
            pieces = rendered.split("<|image_pad|>")
            counts = (data["image_grid_thw"].prod(-1) // QWEN_MERGE**2).tolist()
            rendered = pieces[0] + "".join(
                "<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:], strict=True)
            )
        ids = self.tokenizer(rendered, return_tensors="pt")
        image_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        kinds = (ids.input_ids == image_id).to(torch.int64)
        return BatchFeature({**ids, **data, "mm_token_type_ids": kinds})


IDEFICS_CROP, IDEFICS_PATCH = 16, 4  # a crop of 16 x 16 pixels: 16 patches, 4 tokens after pixel shuffle
IDEFICS_SEQ = (IDEFICS_CROP // IDEFICS_PATCH) ** 2 // 4


def make_idefics3(folder: Path, variant: str = "idefics3", seed: int = 0) -> Path:
    """Build a tiny random Idefics3 (SigLIP-like tower, pixel shuffle by 2, Llama language model), or with
    ``variant="smolvlm"`` a SmolVLM (the same shape), and an Idefics3 processor (images split into crops of
    16 pixels a side plus the whole image), save both. (SmolVLM's own processor needs torchvision for its
    video half, not installed here; its image inputs are the same kind.)"""
    from transformers import (
        AutoModelForImageTextToText,
        Idefics3Config,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        SmolVLMConfig,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    special = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IDEFICS_CROP,
        "patch_size": IDEFICS_PATCH,
    }
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = {"idefics3": Idefics3Config, "smolvlm": SmolVLMConfig}[variant](
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # make the image features loud enough to move the answer
        model.model.connector.modality_projection.proj.weight.mul_(4.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IDEFICS_CROP}, max_image_size={"longest_edge": IDEFICS_CROP}
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IDEFICS_SEQ,
        chat_template=VISION_CHAT_TEMPLATE.replace("<image>\n", "<image>"),
    )
    processor.save_pretrained(str(folder))
    return folder


NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32]]  # the tiling grids (pixels), tiles of 16 x 16


def make_llava_next(folder: Path, seed: int = 0) -> Path:
    """Build a tiny random LLaVA-NeXT (CLIP tower on 16-pixel tiles, anyres grids up to 2 x 2 tiles, Llama
    language model) and its processor, save both."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision, text = _clip_llama(tokenizer)
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=NEXT_PINPOINTS,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    with torch.no_grad():  # make the image features loud enough to move the answer
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=NEXT_PINPOINTS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(str(folder))
    return folder


GEMMA3_TOKENS = 16  # image tokens an image: its 4 x 4 patches, pooled by 1
GEMMA3_SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def gemma3_model(tokenizer, folder: Path, vision: dict, text: dict, tokens: int, size: int, std: float):
    """A random Gemma 3 with a SigLIP tower of ``vision`` (SiglipVisionConfig's arguments) pooled into
    ``tokens`` image tokens, a language model of ``text`` (Gemma3TextConfig's), the projection drawn with
    ``std`` (it starts at zero), and its processor resizing to ``size`` pixels (each image becomes its start
    token, its image tokens and its end token). The tokenizer gets Gemma 3's named image tokens (its processor
    reads ``boi_token``, ``eoi_token``, ``image_token``), saved to ``folder`` and read back. Returns the model,
    the processor and the tokenizer."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_SPECIAL.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=GEMMA3_SPECIAL)
    tokenizer.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_SPECIAL.items()}
    specials = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", **vision},
        text_config=Gemma3TextConfig(**({"vocab_size": len(tokenizer)} | specials | text)),
        mm_tokens_per_image=tokens,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, std)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": size, "width": size}),
        tokenizer=tokenizer,
        chat_template=VISION_CHAT_TEMPLATE.replace("<image>\n", GEMMA3_SPECIAL["boi_token"]),
        image_seq_length=tokens,
    )
    return model, processor, tokenizer


def make_gemma3(folder: Path, seed: int = 0, image_in_vocab: bool = True) -> Path:
    """Build a tiny random Gemma 3 (:func:`gemma3_model`: 16 patches an image pooled by 1 into
    ``GEMMA3_TOKENS``, a language model whose layer 0 has a window of 6 keys, shorter than an image; the
    projection loud enough to move the answer) and its processor, save both. ``image_in_vocab`` False: the
    vocabulary ends before the image token (the tokenizer's last), whose id is then past the embedding,
    as a Gemma 3 config may have it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )
    if not image_in_vocab:  # the tokenizer's vocabulary, less the image token added last (gemma3_model)
        text["vocab_size"] = len(make_tokenizer(folder)) + len(GEMMA3_SPECIAL) - 1
    vision |= {"image_size": IMAGE_SIZE, "patch_size": PATCH}
    torch.manual_seed(seed)
    model, processor, tokenizer = gemma3_model(
        make_tokenizer(folder), folder, vision, text, GEMMA3_TOKENS, IMAGE_SIZE, 1.0
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return folder
