"""Image rows through the engine (LLaVA, float64): greedy tokens equal HF ``generate`` on the processor's
inputs, token for token, with one and two images a row, a text-only row in the same batch, chunked prefill
cutting through an image, and the prefix cache (same image: a hit; another image: no hit, still exact).
Other vision-language families are refused by name, and so is
tensor parallelism with any of them."""

from __future__ import annotations

import pytest
import torch

from batchjob import Engine, SamplingParams
from batchjob.engine.vision import check_family
from batchjob.errors import ConfigError
from tests.tiers import engine_fixture
from tests.vision_models import IMAGE_TOKENS, hf_label_logprob, make_image, make_llava

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = make_llava(tmp_path_factory.mktemp("llava") / "llava")
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    return folder, AutoProcessor.from_pretrained(folder), hf


def _inputs(processor, images, text):
    messages = [
        {"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=images or None, text=rendered, return_tensors="pt")


def _hf_greedy(hf, inputs) -> list[int]:
    kwargs = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
    if "pixel_values" in inputs:
        kwargs["pixel_values"] = inputs.pixel_values.double()
    with torch.inference_mode():
        out = hf.generate(
            **kwargs, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, inputs.input_ids.shape[1] :].tolist()


def _run(engine, rows) -> list[list[int]]:
    for i, inputs in enumerate(rows):
        # the processor's image outputs as they come (a mapping); the tensor form is the error test's
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")} or None
        engine.add_request(f"r{i}", inputs.input_ids[0].tolist(), GREEDY, images=images)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            outs[o.request_id] = o.token_ids
    return [outs[f"r{i}"] for i in range(len(rows))]


ROWS = [
    ([1], "What is it?"),
    ([2, 3], "Compare these two."),
    ([], "The quick brown fox"),
    ([4], "Paris is"),
    ([5], "What is it?"),  # the first row's text under another image
]


@pytest.mark.parametrize("budget", [512, 20], ids=["whole", "chunked"])
def test_images_equal_hf_generate(llava, budget):
    """One and two images a row, a text-only row, a chunk budget (20) smaller than an image (16 tokens)
    after the template's tokens: every row's tokens equal HF generate's; the images change the answer."""
    folder, processor, hf = llava
    rows = [_inputs(processor, [make_image(s) for s in seeds], text) for seeds, text in ROWS]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=8, max_num_batched_tokens=budget
    )
    assert _run(engine, rows) == expected
    assert expected[0] != expected[4], "two images under the same text should answer differently"
    # the features are the penultimate layer's (vision_feature_layer -2): the last layer is not kept
    layers = engine.model.model.vision_tower.encoder.layers
    assert len(layers) == len(hf.model.vision_tower.encoder.layers) - 1 == 1
    assert engine.vision.encoded_images == 5  # once per image, never again
    # One tower call (80 patches, under max_patches): at 512 every request's images are in the first step;
    # at 20 that step holds the first row's image alone and the call takes the next rows' too.
    assert engine.vision.tower_calls == 1


@pytest.mark.engine
def test_features_from_several_tower_layers_drop_only_the_layers_after_them(tmp_path):
    """``vision_feature_layer`` as a list (the features of several layers, concatenated): the tower keeps
    every layer up to the last one named, and every row equals HF generate."""
    from transformers import (
        AutoModelForImageTextToText,
        AutoProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    folder = make_llava(tmp_path / "llava")
    config = LlavaConfig.from_pretrained(folder)
    config.vision_feature_layer = [-3, -2]  # the embeddings' output and the first layer's, of 2 layers
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)  # the projector takes both: twice as wide
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).eval()
    processor = AutoProcessor.from_pretrained(folder)
    rows = [_inputs(processor, [make_image(seed)], "What is it?") for seed in (1, 2)]
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=64, block_size=8)
    assert _run(engine, rows) == [_hf_greedy(hf, inputs) for inputs in rows]
    assert len(engine.model.model.vision_tower.encoder.layers) == 1
    assert engine.vision.family.feature_layer == [0, 1]


# Labels of 2 and 3 tokens sharing first tokens: the greedy walk leaves most trie nodes to scoring requests.
CHOICES = ["cat", "cab", "car", "dog", "dot", "blue", "blur"]


def test_choices_score_every_label_with_the_rows_images(llava):
    """Each label's log-probability on an image row equals HF's float64 forward of the prompt, its image and
    the label, and the answer is HF's most likely label (a text row beside it too). The labels off the greedy
    walk were scored by requests without the row's images (its image tokens read as text): the probe's LLaVA
    wrote 'car' where HF scores 'red' higher (-12.204 against -12.589), up to 0.53 nats off."""
    folder, processor, hf = llava
    rows = [
        _inputs(processor, [make_image(s) for s in seeds], "Answer in a word.") for seeds in ([1], [2, 3], [])
    ]
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=128, block_size=8)
    params = SamplingParams(temperature=0.0, choices=CHOICES)
    for i, inputs in enumerate(rows):
        images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")} or None
        engine.add_request(f"r{i}", inputs.input_ids[0].tolist(), params, images=images)
    outs = {o.request_id: o for _ in range(100) if engine.has_unfinished() for o in engine.step()}
    tokens = {label: engine.tokenize(label, special_tokens=False) for label in CHOICES}
    for i, inputs in enumerate(rows):
        want = {label: hf_label_logprob(hf, inputs, ids) for label, ids in tokens.items()}
        out = outs[f"r{i}"]
        assert out.error is None and out.choice_logprobs == pytest.approx(want, abs=1e-9, rel=0), i
        assert out.text == max(want, key=want.get)
    assert engine.vision.encoded_images == 3  # the scoring requests take the rows' features, never again


def test_a_steps_images_are_encoded_in_calls_of_bounded_patches(llava):
    """One tower call takes at most ``max_patches`` patches (the step's token budget, at least 2,048), a
    request whole: with a bound under two images' 32 patches, the first step's four image requests go in four
    calls, and every row is still exact."""
    folder, processor, hf = llava
    rows = [_inputs(processor, [make_image(s) for s in seeds], text) for seeds, text in ROWS]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=8, max_num_batched_tokens=512
    )
    assert engine.vision.max_patches == 2048
    engine.vision.max_patches = 20  # one image's 16 patches fit, two do not; the two-image row goes alone
    assert _run(engine, rows) == expected
    assert engine.vision.tower_calls == 4 and engine.vision.encoded_images == 5


def test_prefix_cache_keys_on_the_image(llava):
    """The same image and text again reuses the cached blocks holding image tokens; the same text under
    another image reuses none of them (the prompt starts with the image's tokens at once) and is exact."""
    folder, processor, hf = llava
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=128, block_size=4, enable_prefix_caching=True
    )
    first = _inputs(processor, [make_image(7)], "What is it?")
    image_start = first.input_ids[0].tolist().index(engine.vision.image_token_id)
    _run(engine, [first])
    before = engine.stats.cached_prompt_tokens
    same = _inputs(processor, [make_image(7)], "What is it?")
    assert _run(engine, [same]) == [_hf_greedy(hf, same)]
    hit = engine.stats.cached_prompt_tokens - before
    assert hit >= image_start + IMAGE_TOKENS, (hit, image_start)
    other = _inputs(processor, [make_image(8)], "What is it?")
    before = engine.stats.cached_prompt_tokens
    assert _run(engine, [other]) == [_hf_greedy(hf, other)]
    miss = engine.stats.cached_prompt_tokens - before
    assert miss <= image_start, (miss, image_start)  # at most the text before the image


def test_a_call_takes_the_next_requests_images_but_not_those_the_cache_holds(llava):
    """With one seat, each request's image has a step of its own; the first call also encodes the waiting
    requests' new images, and not the one whose image blocks the prefix cache holds (a request run before
    had the same image and text): that request takes the blocks, and every row is exact."""
    folder, processor, hf = llava
    engine = Engine.from_pretrained(
        folder,
        device="cpu",
        dtype="float64",
        num_blocks=128,
        block_size=4,
        enable_prefix_caching=True,
        max_num_seqs=1,
    )
    _run(engine, [_inputs(processor, [make_image(7)], "What is it?")])
    calls, encoded = engine.vision.tower_calls, engine.vision.encoded_images
    rows = [_inputs(processor, [make_image(seed)], "What is it?") for seed in (8, 7, 9)]
    assert _run(engine, rows) == [_hf_greedy(hf, inputs) for inputs in rows]
    assert engine.vision.encoded_images - encoded == 2  # images 8 and 9; 7's blocks came from the cache
    assert engine.vision.tower_calls - calls == 1


def test_image_tokens_and_images_must_agree(llava):
    """A prompt whose image tokens are not the images' finishes with an error naming both counts."""
    folder, processor, _ = llava
    engine = Engine.from_pretrained(folder, device="cpu", dtype="float64", num_blocks=64, block_size=8)
    inputs = _inputs(processor, [make_image(1)], "What is it?")
    two = torch.cat([inputs.pixel_values, inputs.pixel_values])
    engine.add_request("bad", inputs.input_ids[0].tolist(), GREEDY, images=two)
    (out,) = engine.step()
    assert out.finish_reason == "error" and "16 image tokens" in out.error and "2 image(s)" in out.error
    # image tokens and no images at all (a text row whose text holds the image token): an error, not text
    engine.add_request("none", inputs.input_ids[0].tolist(), GREEDY)
    (out,) = engine.step()
    assert out.finish_reason == "error" and "16 image tokens" in out.error and "0 image(s)" in out.error


def test_other_vision_families_are_refused_by_name():
    from transformers import Gemma3Config, PaliGemmaConfig

    supported = "supported: llava, llava_next, qwen2_vl, qwen2_5_vl, idefics3, smolvlm, gemma3"
    with pytest.raises(ConfigError, match=f"family 'paligemma' is not supported yet; {supported}"):
        check_family(PaliGemmaConfig())
    check_family(Gemma3Config())  # runs (its image tokens both ways: test_vision_gemma3.py)


def test_every_supported_family_has_its_rules():
    """The loader's list (family.py, no torch) and the families the hook builds are the same."""
    from batchjob.engine.vision import FAMILIES, SUPPORTED

    assert set(SUPPORTED) == set(FAMILIES)


def test_preempted_image_rows_recompute_exactly(llava):
    """A KV pool too small for every row at once: preempted rows recompute their image tokens from the
    features they keep (the vision tower runs once per image all the same) and still equal HF generate."""
    folder, processor, hf = llava
    rows = [_inputs(processor, [make_image(s) for s in seeds], text) for seeds, text in ROWS]
    expected = [_hf_greedy(hf, inputs) for inputs in rows]
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float64", num_blocks=40, block_size=4, max_num_batched_tokens=64
    )
    assert _run(engine, rows) == expected
    assert engine.stats.preemptions > 0
    assert engine.vision.encoded_images == 5


def test_a_refused_family_is_named_before_its_weights_are_read(tmp_path):
    """A PaliGemma folder (its config alone: no weights, no tokenizer) is refused by the loader and by the
    engine's plan (what ``batchjob validate`` runs), by family, before anything else is read."""
    from transformers import PaliGemmaConfig

    from batchjob.engine.config import EngineConfig
    from batchjob.engine.plan import plan_model
    from batchjob.models import load_config, load_model_and_tokenizer

    PaliGemmaConfig().save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="family 'paligemma' is not supported yet"):
        load_model_and_tokenizer(str(tmp_path), torch.float32, "cpu")
    config, _ = load_config(str(tmp_path))
    with pytest.raises(ConfigError, match="family 'paligemma' is not supported yet"):
        plan_model(config, EngineConfig(device="cpu"))


def test_tensor_parallelism_is_refused_by_name_before_any_rank_starts(llava):
    """A vision-language model with tensor_parallel_size 2: a ConfigError naming it, before a rank starts
    or a weight is read (the folder's weights are taken away first: reading them would fail otherwise)."""
    import shutil

    folder, _, _ = llava
    configs = folder.parent / "config_only"
    configs.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, configs / name)
    with pytest.raises(ConfigError, match="vision-language models run without tensor parallelism"):
        Engine.from_pretrained(str(configs), device="cpu", dtype="float64", tensor_parallel_size=2)
