"""Idefics3 and SmolVLM image rows through the engine (float64): the processor splits each image into crops of 16
pixels plus the whole image, so images of different shapes take different numbers of tokens (4 a crop
after pixel shuffle). Greedy tokens equal HF ``generate`` on the processor's inputs, token for token (and
log-probability for log-probability): one and two images a row, a text-only row in the same batch, chunked
prefill cutting through an image, preemption, the prefix cache (same image: a hit; another: no hit)."""

from __future__ import annotations

import pytest
import torch

from batchjob import Engine
from tests.engine.test_vision_qwen import GREEDY, _run, _same
from tests.tiers import engine_fixture
from tests.vision_models import IDEFICS_SEQ, make_idefics3, make_image

pytestmark = pytest.mark.timeout(600)


@engine_fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = make_idefics3(tmp_path_factory.mktemp(request.param) / "model", request.param)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    assert hf.config.model_type == request.param
    return folder, AutoProcessor.from_pretrained(folder), hf


def _inputs(processor, images, text):
    messages = [
        {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=images or None, text=rendered, return_tensors="pt")


def _hf_greedy(hf, inputs) -> list[tuple[int, float]]:
    """HF generate's greedy tokens, each with its log-probability from one float64 forward."""
    kwargs = dict(inputs)
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].double()
    n = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = hf.generate(
            **kwargs, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        kwargs |= {"input_ids": out, "attention_mask": torch.ones_like(out)}
        kwargs.pop("mm_token_type_ids", None)
        logits = hf(**kwargs).logits[0, n - 1 : -1].log_softmax(-1)
    return [(t, logits[i, t].item()) for i, t in enumerate(out[0, n:].tolist())]


ROWS = [  # (seed, (width, height)) per image, text
    ([(1, (24, 20))], "What is it?"),  # 2 x 2 crops and the whole: 5 crops
    ([(2, (40, 16)), (3, (16, 16))], "Compare these two."),  # 3 and 5 crops
    ([], "The quick brown fox"),
    ([(4, (24, 20))], "What is it?"),  # the first row's text under another image
]


def _rows(processor):
    return [_inputs(processor, [make_image(s, size) for s, size in images], text) for images, text in ROWS]


@pytest.mark.parametrize("budget", [512, 10], ids=["whole", "chunked"])
def test_images_equal_hf_generate(idefics, budget):
    """Every row equals HF generate, whole or in chunks of 10 tokens (cutting crops' token runs); the images
    change the answer; the tower runs once per crop."""
    folder, processor, hf = idefics
    rows = _rows(processor)
    assert [(r["input_ids"] == hf.config.image_token_id).sum().item() for r in rows] == [20, 32, 0, 20]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=8, max_num_batched_tokens=budget
    )
    _same(_run(engine, rows), expected)
    assert expected[0] != expected[3], "two images under the same text should answer differently"
    assert engine.vision.encoded_images == (5 + 8 + 5)


def test_preempted_image_rows_recompute_exactly(idefics):
    """A KV pool too small for every row at once: preempted rows recompute from the features they keep."""
    folder, processor, hf = idefics
    rows = _rows(processor)
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=40, block_size=4, max_num_batched_tokens=64
    )
    _same(_run(engine, rows), expected)
    assert engine.stats.preemptions > 0
    assert engine.vision.encoded_images == (5 + 8 + 5)


def test_prefix_cache_keys_on_the_image(idefics):
    """The same image and text again reuses the blocks holding every crop's tokens; another image none."""
    folder, processor, hf = idefics
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, enable_prefix_caching=True
    )
    first = _inputs(processor, [make_image(7)], "What is it?")
    ids = first["input_ids"][0].tolist()
    image_start = ids.index(engine.vision.image_token_id)
    image_end = len(ids) - ids[::-1].index(engine.vision.image_token_id)  # past the last crop's tokens
    _run(engine, [first])
    before = engine.stats.cached_prompt_tokens
    same = _inputs(processor, [make_image(7)], "What is it?")
    _same(_run(engine, [same]), [_hf_greedy(hf, same)])
    assert engine.stats.cached_prompt_tokens - before >= image_end // 4 * 4 > image_start + 4 * IDEFICS_SEQ
    other = _inputs(processor, [make_image(8)], "What is it?")
    before = engine.stats.cached_prompt_tokens
    _same(_run(engine, [other]), [_hf_greedy(hf, other)])
    assert engine.stats.cached_prompt_tokens - before <= image_start


def test_crops_larger_than_the_towers_image_size_equal_hf_generate(idefics):
    """A processor cropping at twice the tower's image_size (max_image_size, image_seq_len 16): the tower takes
    any size (its position buckets), so HF answers; a crop's tokens follow its pixels, not the config (every
    image row was an error, its tokens counted at 4 a crop)."""
    import copy

    folder, processor, hf = idefics
    big = copy.deepcopy(processor)
    crop = 2 * hf.config.vision_config.image_size
    big.image_processor.max_image_size = {"longest_edge": crop}
    big.image_processor.size = {"longest_edge": 2 * crop}
    big.image_seq_len = 16
    rows = [_inputs(big, [make_image(s, size) for s, size in images], text) for images, text in ROWS]
    assert rows[0]["pixel_values"].shape[-1] == crop
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=128, block_size=8)
    _same(_run(engine, rows), [_hf_greedy(hf, inputs) for inputs in rows])
