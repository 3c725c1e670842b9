"""Gemma 3 image rows (float64): each image's tokens attend both ways within the image (the model's
``token_type_ids`` mask), causal around it, and the first layer's window (6 keys) is shorter than an image
(16 tokens). Greedy tokens equal HF ``generate`` on the processor's inputs, token for token and
log-probability for log-probability: one and two images a row, a text-only row in the same batch, chunks
that would cut an image (they end before it instead), preemption, the prefix cache; an image longer than
a step's budget is its row's error. Plus the chunk and key rules themselves, in pure Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob import Engine
from batchjob.engine.vision.state import Images, runs_of
from tests.engine.test_vision_idefics import _hf_greedy, _inputs
from tests.engine.test_vision_qwen import GREEDY, _run, _same
from tests.tiers import engine_fixture
from tests.vision_models import GEMMA3_TOKENS, make_gemma3, make_image

pytestmark = pytest.mark.timeout(600)


def test_chunks_never_end_inside_an_image_and_its_tokens_see_it_whole():
    positions = np.r_[3:7, 9:12].astype(np.int64)  # two images: 4 tokens at 3-6, 3 at 9-11
    images = Images({}, positions, np.array([0, 4, 7]), [b"a", b"b"], runs=runs_of(positions))
    assert images.runs.tolist() == [[3, 7], [9, 12]]
    assert images.cut(0, 5) == 3  # a chunk that would cut the first image ends before it
    assert images.cut(0, 7) == 7 and images.cut(0, 20) == 20  # one that holds it whole stays
    assert images.cut(3, 5) == 3  # from the image's start without room for all of it: none this step
    assert images.cut(5, 6) == 5  # from inside it (a cached prefix) the same: the rest waits for room
    assert images.cut(7, 10) == 9
    assert images.key_ends(2, 10).tolist() == [3, 7, 7, 7, 7, 8, 9, 12]  # image tokens see to its end
    assert runs_of(np.zeros(0, np.int64)).shape == (0, 2)


@engine_fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = make_gemma3(tmp_path_factory.mktemp("gemma3") / "model")
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    assert hf.config.model_type == "gemma3"
    return folder, AutoProcessor.from_pretrained(folder), hf


ROWS = [
    ([1], "What is it?"),
    ([2, 3], "Compare these two."),
    ([], "The quick brown fox"),
    ([4], "What is it?"),  # the first row's text under another image
]


def _rows(processor):
    return [_inputs(processor, [make_image(s) for s in seeds], text) for seeds, text in ROWS]


def test_the_image_mask_moves_the_answer(gemma3):
    """HF's own answer with the image tokens causal (no ``token_type_ids``) is another: a causal engine
    could not pass the tests below."""
    _, processor, hf = gemma3
    inputs = _rows(processor)[0]
    causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    both, one = _hf_greedy(hf, inputs), _hf_greedy(hf, causal)
    assert max(abs(a[1] - b[1]) for a, b in zip(both, one, strict=True)) > 1e-6


@pytest.mark.parametrize("budget", [512, 20], ids=["whole", "chunked"])
def test_images_equal_hf_generate(gemma3, budget):
    """Whole, or in chunks of at most 20 tokens: a chunk that would end inside an image ends before it,
    and the next holds the image whole."""
    folder, processor, hf = gemma3
    rows = _rows(processor)
    assert [(r["input_ids"] == hf.config.image_token_id).sum().item() for r in rows] == [16, 32, 0, 16]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, max_num_batched_tokens=budget
    )
    _same(_run(engine, rows), expected)
    assert expected[0] != expected[3], "two images under the same text should answer differently"
    assert engine.vision.encoded_images == 4


def test_preempted_image_rows_recompute_exactly(gemma3):
    folder, processor, hf = gemma3
    rows = _rows(processor)
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=24, block_size=4, max_num_batched_tokens=64
    )
    _same(_run(engine, rows), expected)
    assert engine.stats.preemptions > 0
    assert engine.vision.encoded_images == 4


def test_prefix_cache_keys_on_the_image(gemma3):
    """The same image and text again takes the blocks past the image from the cache; another image none."""
    folder, processor, hf = gemma3
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, enable_prefix_caching=True
    )
    first = _inputs(processor, [make_image(7)], "What is it?")
    ids = first["input_ids"][0].tolist()
    image_start = ids.index(engine.vision.image_token_id)
    _run(engine, [first])
    before = engine.stats.cached_prompt_tokens
    same = _inputs(processor, [make_image(7)], "What is it?")
    _same(_run(engine, [same]), [_hf_greedy(hf, same)])
    assert engine.stats.cached_prompt_tokens - before >= image_start + GEMMA3_TOKENS
    other = _inputs(processor, [make_image(8)], "What is it?")
    before = engine.stats.cached_prompt_tokens
    _same(_run(engine, [other]), [_hf_greedy(hf, other)])
    assert engine.stats.cached_prompt_tokens - before <= image_start


def test_an_image_longer_than_a_step_is_its_rows_error(gemma3):
    """A budget of 12 tokens a step cannot hold a 16-token image whole: that row's error says what to set;
    the text row beside it runs."""
    folder, processor, _ = gemma3
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=64, block_size=4, max_num_batched_tokens=12
    )
    image_row, text_row = _rows(processor)[0], _rows(processor)[2]
    for name, inputs in (("image", image_row), ("text", text_row)):
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        engine.add_request(name, inputs["input_ids"][0].tolist(), GREEDY, images=images)
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step()}
    assert outs["image"].finish_reason == "error"
    assert "an image of 16 tokens attends both ways" in outs["image"].error
    assert (
        "max_num_batched_tokens (--max-num-batched-tokens) must be at least 16, not 12" in outs["image"].error
    )
    assert outs["text"].error is None and len(outs["text"].token_ids) == GREEDY.max_new_tokens


def test_float32_image_rows_attend_on_the_prefill_kernel(gemma3):
    """In float32 the CPU's prefill kernel computes the image steps, each image token seeing its image to the
    end (``key_ends``) within the windowed layer's 6 keys: greedy tokens equal float64's and their
    log-probabilities agree within float32's rounding."""
    from batchjob.engine.cpu import kernel

    if not kernel.prefill_takes(torch.float32, 16):
        pytest.skip("the float32 prefill kernel needs a C++ compiler")
    folder, processor, _ = gemma3
    rows = _rows(processor)
    options = dict(device="cpu", num_blocks=128, block_size=4, max_num_batched_tokens=20)
    exact = _run(Engine.from_pretrained(folder, dtype="float64", **options), rows)
    seen = []
    plain = kernel.paged_prefill
    try:
        kernel.paged_prefill = lambda *a, **k: seen.append(a[10] is not None) or plain(*a, **k)
        got = _run(Engine.from_pretrained(folder, dtype="float32", **options), rows)
    finally:
        kernel.paged_prefill = plain
    assert any(seen) and not all(seen)  # image steps with their key ends, text steps without
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in exact]
    for row, want in zip(got, exact, strict=True):
        assert [lp for _, lp in row] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.mark.engine  # builds a model
def test_an_image_token_past_the_vocabulary_is_the_rows_error(tmp_path):
    """A config whose image token id is past the embedding table (HF embeds it as id 0 and overwrites the
    row; no supported checkpoint has one): the engine does not guess, the row's error names the id."""
    from transformers import AutoProcessor

    folder = make_gemma3(tmp_path / "model", image_in_vocab=False)
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=64, block_size=4)
    inputs = _rows(AutoProcessor.from_pretrained(folder))[0]
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    engine.add_request("r", inputs["input_ids"][0].tolist(), GREEDY, images=images)
    (out,) = engine.step()
    image_id = engine.vision.image_token_id
    assert out.finish_reason == "error"
    assert out.error == f"token id {image_id} is outside the vocabulary (size {image_id})"
