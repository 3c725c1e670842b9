"""Qwen2-VL and Qwen2.5-VL image rows through the engine (float64): images of different sizes take different
numbers of tokens, and the language model rotates by 3-D M-RoPE positions (the prompt's from the model's
``get_rope_index``, later tokens shifted by its delta). Greedy tokens equal HF ``generate`` on the same
inputs, token for token (and log-probability for log-probability): one and two images a row, a text-only row in the same batch, chunked prefill cutting
through an image, preemption, the prefix cache (same image: a hit; another image: no hit, still exact)."""

from __future__ import annotations

import pytest
import torch

from batchjob import Engine, SamplingParams
from tests.tiers import engine_fixture
from tests.vision_models import QwenProcessor, hf_label_logprob, make_image, make_qwen2_vl

pytestmark = pytest.mark.timeout(600)

# With each token's log-probability: positions a little off would still pick the same tokens of a tiny
# random model now and then, never the same log-probabilities (float64: equal to 1e-9).
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0, logprobs=1)


@engine_fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    folder = make_qwen2_vl(tmp_path_factory.mktemp(request.param) / "model", request.param)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, QwenProcessor(folder), hf


def _hf_greedy(hf, inputs) -> list[tuple[int, float]]:
    """HF generate's greedy tokens, each with its log-probability from one float64 forward of the prompt
    and those tokens (generate hands its logits out in float32)."""
    kwargs = dict(inputs)
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].double()
    n = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = hf.generate(
            **kwargs, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        grown = {"input_ids": out, "attention_mask": torch.ones_like(out)}
        grown["mm_token_type_ids"] = torch.nn.functional.pad(
            kwargs["mm_token_type_ids"], (0, out.shape[1] - n)
        )
        kwargs.update(grown)
        logits = hf(**kwargs).logits[0, n - 1 : -1].log_softmax(-1)
    tokens = out[0, n:].tolist()
    return [(t, logits[i, t].item()) for i, t in enumerate(tokens)]


def _run(engine, rows) -> list[list[tuple[int, float]]]:
    """The engine's greedy tokens of each row, each with its log-probability."""
    for i, inputs in enumerate(rows):
        # the processor's outputs less the token ids, as the job layer passes them (a text row's too)
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        engine.add_request(f"r{i}", inputs["input_ids"][0].tolist(), GREEDY, images=images)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            outs[o.request_id] = [(t, top[0][1]) for t, top in zip(o.token_ids, o.logprobs, strict=True)]
    return [outs[f"r{i}"] for i in range(len(rows))]


def _same(got, expected) -> None:
    """Token for token, and each token's log-probability to 1e-9."""
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    for row, want in zip(got, expected, strict=True):
        assert [lp for _, lp in row] == pytest.approx([lp for _, lp in want], abs=1e-9, rel=0)


ROWS = [  # (seed, (width, height)) per image, text
    ([(1, (24, 20))], "What is it?"),
    ([(2, (40, 16)), (3, (16, 32))], "Compare these two."),  # 10 and 8 tokens
    ([], "The quick brown fox"),
    ([(4, (48, 40))], "Paris is"),  # 30 tokens
    ([(3, (24, 20))], "What is it?"),  # the first row's text under another image
]


def _rows(processor):
    return [processor([make_image(s, size) for s, size in images], text) for images, text in ROWS]


@pytest.mark.parametrize("budget", [512, 12], ids=["whole", "chunked"])
def test_images_equal_hf_generate(qwen, budget):
    """Every row's tokens equal HF generate's, whole prompts in one step or in chunks of 12 tokens (which
    cut the 30-token image and the two-image row); the images change the answer; the vision tower runs
    once per image."""
    folder, processor, hf = qwen
    rows = _rows(processor)
    counts = [r["image_grid_thw"].prod(-1).tolist() if "image_grid_thw" in r else [] for r in rows]
    assert counts[1] == [40, 32] and counts[3] == [120], counts  # patches: 10, 8 and 30 tokens (merge 2x2)
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=8, max_num_batched_tokens=budget
    )
    _same(_run(engine, rows), expected)
    assert expected[0] != expected[4], "two images under the same text should answer differently"
    assert engine.vision.encoded_images == 5


def test_choices_score_every_label_with_the_rows_images_and_positions(qwen):
    """Each label's log-probability on an image row equals HF's float64 forward of the prompt, its images and
    the label: the requests that score the labels off the greedy walk take the row's features and its M-RoPE
    positions (they had neither: image tokens read as text, at plain positions), and the answer is HF's most
    likely label."""
    folder, processor, hf = qwen
    rows = _rows(processor)[:3]  # one image, two images, text
    labels = ["cat", "cab", "car", "dog", "dot", "blue", "blur"]  # shared first tokens: nodes off the walk
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=128, block_size=8)
    params = SamplingParams(temperature=0.0, choices=labels)
    for i, inputs in enumerate(rows):
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        engine.add_request(f"r{i}", inputs["input_ids"][0].tolist(), params, images=images)
    outs = {o.request_id: o for _ in range(100) if engine.has_unfinished() for o in engine.step()}
    for i, inputs in enumerate(rows):
        want = {x: hf_label_logprob(hf, inputs, engine.tokenize(x, special_tokens=False)) for x in labels}
        out = outs[f"r{i}"]
        assert out.error is None and out.choice_logprobs == pytest.approx(want, abs=1e-9, rel=0), i
        assert out.text == max(want, key=want.get)
    assert engine.vision.encoded_images == 3


def test_preempted_image_rows_recompute_exactly(qwen):
    """A KV pool too small for every row at once: preempted rows recompute from the features and the
    M-RoPE positions they keep (the vision tower runs once per image all the same), still exact."""
    folder, processor, hf = qwen
    rows = _rows(processor)
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(  # with decode graphs: steps holding an M-RoPE request stay eager
        folder,
        device="cpu",
        dtype="float64",
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=64,
        cuda_graphs=True,
    )
    _same(_run(engine, rows), expected)
    assert engine.stats.preemptions > 0
    assert engine.vision.encoded_images == 5


def test_prefix_cache_keys_on_the_image(qwen):
    """The same image and text again reuses the cached blocks holding image tokens; another image of the
    same size under the same text reuses none of them, and both are exact."""
    folder, processor, hf = qwen
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, enable_prefix_caching=True
    )
    first = processor([make_image(7, (48, 40))], "What is it?")
    ids = first["input_ids"][0].tolist()
    image_start = ids.index(engine.vision.image_token_id)
    _run(engine, [first])
    before = engine.stats.cached_prompt_tokens
    same = processor([make_image(7, (48, 40))], "What is it?")
    _same(_run(engine, [same]), [_hf_greedy(hf, same)])
    assert engine.stats.cached_prompt_tokens - before >= image_start + 30
    other = processor([make_image(8, (48, 40))], "What is it?")
    before = engine.stats.cached_prompt_tokens
    _same(_run(engine, [other]), [_hf_greedy(hf, other)])
    assert engine.stats.cached_prompt_tokens - before <= image_start  # at most the text before the image


def test_image_tokens_and_grids_must_agree(qwen):
    """Image tokens that are not what the grids say finish the request with an error naming both; a grid
    that does not describe the patches is refused at add_request, naming it."""
    from batchjob.errors import ConfigError

    folder, processor, _ = qwen
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=64, block_size=8)
    one = processor([make_image(1, (24, 20))], "What is it?")
    two = processor([make_image(1, (24, 20)), make_image(2, (40, 16))], "What is it?")
    images = {k: two[k] for k in ("pixel_values", "image_grid_thw")}
    engine.add_request("bad", one["input_ids"][0].tolist(), GREEDY, images=images)
    (out,) = engine.step()
    assert out.finish_reason == "error", out
    assert "6 image tokens" in out.error and "2 image(s) of [6, 10] tokens" in out.error, out.error
    wrong = {"pixel_values": one["pixel_values"], "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ConfigError, match="image_grid_thw"):
        engine.add_request("grid", one["input_ids"][0].tolist(), GREEDY, images=wrong)


def test_text_rows_alone_are_the_text_path(qwen):
    """Rows without images on a Qwen2-VL model take plain positions (the model repeats them 3x) and the
    text path, decode graphs included, and equal HF generate; a video is refused by name, not read as text."""
    from batchjob.errors import ConfigError

    folder, processor, hf = qwen
    rows = [processor([], text) for text in ("The quick brown fox", "Paris is the capital of")]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=64, block_size=8, cuda_graphs=True
    )
    assert engine.runner.graphs is not None  # decode steps through the graphs' padded buffers (eager on CPU)
    _same(_run(engine, rows), expected)
    assert engine.vision.encoded_images == 0
    video = {"pixel_values_videos": torch.zeros(8, 96), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    with pytest.raises(ConfigError, match="videos .pixel_values_videos. are not supported"):
        engine.add_request("video", rows[0]["input_ids"][0].tolist(), GREEDY, images=video)


def test_block_bytes_follow_images_of_different_sizes():
    """A block's image bytes are the digests of exactly the images with a token in it (6 and 10 tokens)."""
    import numpy as np

    from batchjob.engine.vision import Images

    positions = np.concatenate([np.arange(3, 9), np.arange(12, 22)])
    images = Images({}, positions, np.array([0, 6, 16]), [b"a", b"b"])
    assert images.block_bytes(0, 4) == b"a"
    assert images.block_bytes(8, 13) == b"ab"
    assert images.block_bytes(9, 12) == b""
    assert images.block_bytes(14, 22) == b"b"
    assert images.block_bytes(22, 30) == b""


def test_a_resumed_image_row_continues_exactly(qwen):
    """A row resumed with the tokens it had generated (``output_ids``, as after a restart) recomputes its
    prompt's M-RoPE positions and continues at index + delta: the rest equals the uninterrupted run."""
    folder, processor, hf = qwen
    inputs = processor([make_image(2, (40, 16)), make_image(3, (16, 32))], "Compare these two.")
    expected = _hf_greedy(hf, inputs)
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=64, block_size=8)
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    done = [t for t, _ in expected[:3]]
    engine.add_request("r", inputs["input_ids"][0].tolist(), GREEDY, output_ids=done, images=images)
    outs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step()]
    (out,) = outs
    assert out.token_ids == [t for t, _ in expected], (out.token_ids, expected)
