"""LLaVA-NeXT image rows through the engine (float64): anyres tiling makes an image's token count follow
its size (the whole image, then its tiles unpadded to its aspect with a newline a row). Greedy tokens equal
HF ``generate`` on the processor's inputs, token for token (and log-probability for log-probability): one
and two images a row, a text-only row in the same batch, chunked prefill, preemption, the prefix cache."""

from __future__ import annotations

import pytest
import torch

from batchjob import Engine
from tests.engine.test_vision_idefics import _hf_greedy, _inputs
from tests.engine.test_vision_qwen import _run, _same
from tests.tiers import engine_fixture
from tests.vision_models import make_image, make_llava_next

pytestmark = pytest.mark.timeout(600)


@engine_fixture(scope="module")
def next_model(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = make_llava_next(tmp_path_factory.mktemp("llava_next") / "model")
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, AutoProcessor.from_pretrained(folder), hf


ROWS = [  # (seed, (width, height)) per image, text
    ([(1, (24, 20))], "What is it?"),  # 2 x 2 tiles: 70 tokens
    ([(2, (40, 16)), (3, (16, 16))], "Compare these two."),  # 52 and 36 tokens
    ([], "The quick brown fox"),
    ([(4, (16, 40))], "What is it?"),  # 56 tokens
]


def _rows(processor):
    return [_inputs(processor, [make_image(s, size) for s, size in images], text) for images, text in ROWS]


@pytest.mark.parametrize("budget", [512, 24], ids=["whole", "chunked"])
def test_images_equal_hf_generate(next_model, budget):
    """Every row equals HF generate, whole or in chunks of 24 tokens; images of different sizes take the
    tokens the processor gave them; the images change the answer; the tower runs once per image."""
    folder, processor, hf = next_model
    rows = _rows(processor)
    assert [(r["input_ids"] == hf.config.image_token_id).sum().item() for r in rows] == [70, 88, 0, 56]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=8, max_num_batched_tokens=budget
    )
    _same(_run(engine, rows), expected)
    assert expected[0] != expected[3], "two images under the same text should answer differently"
    assert engine.vision.encoded_images == 4


def test_preempted_image_rows_recompute_exactly(next_model):
    """A KV pool too small for every row at once: preempted rows recompute from the features they keep."""
    folder, processor, hf = next_model
    rows = _rows(processor)
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=40, block_size=4, max_num_batched_tokens=64
    )
    _same(_run(engine, rows), expected)
    assert engine.stats.preemptions > 0
    assert engine.vision.encoded_images == 4


def test_prefix_cache_keys_on_the_image(next_model):
    """The same image and text again reuses the blocks holding its tokens; another image of the same size
    under the same text none of them; both exact."""
    folder, processor, hf = next_model
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, enable_prefix_caching=True
    )
    first = _inputs(processor, [make_image(7)], "What is it?")
    image_start = first["input_ids"][0].tolist().index(engine.vision.image_token_id)
    _run(engine, [first])
    before = engine.stats.cached_prompt_tokens
    same = _inputs(processor, [make_image(7)], "What is it?")
    _same(_run(engine, [same]), [_hf_greedy(hf, same)])
    assert engine.stats.cached_prompt_tokens - before >= image_start + 70
    other = _inputs(processor, [make_image(8)], "What is it?")
    before = engine.stats.cached_prompt_tokens
    _same(_run(engine, [other]), [_hf_greedy(hf, other)])
    assert engine.stats.cached_prompt_tokens - before <= image_start


def test_a_processor_cutting_another_grid_than_the_models_is_the_rows_error(next_model):
    """A folder whose processor tiles on other image_grid_pinpoints than the model unpacks: the image's tiles
    are not the model's (too few failed the whole tower call and the job with it, too many were cut without a
    word): that row's error, naming both; the other rows run."""
    import copy

    from tests.engine.test_vision_qwen import GREEDY

    folder, processor, hf = next_model
    other = copy.deepcopy(processor)
    other.image_processor.image_grid_pinpoints = [[16, 16], [16, 64], [64, 16], [32, 32], [16, 48], [48, 16]]
    rows = [
        _inputs(other, [make_image(9, (10, 10))], "What is it?"),  # 2 tiles, where the model takes 3
        _inputs(other, [make_image(9, (100, 5))], "What is it?"),  # 5 tiles, where the model takes 3
        _inputs(processor, [make_image(1, (24, 20))], "What is it?"),
    ]
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=128, block_size=8)
    for i, inputs in enumerate(rows):
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        engine.add_request(f"r{i}", inputs["input_ids"][0].tolist(), GREEDY, images=images)
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step()}
    assert "the processor cut 2 tiles where the model's image_grid_pinpoints give 3" in outs["r0"].error
    assert "the processor cut 5 tiles" in outs["r1"].error
    assert outs["r2"].error is None and outs["r2"].token_ids
