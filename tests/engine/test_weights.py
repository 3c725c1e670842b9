"""Weights that would make every answer noise without a word: a checkpoint lacking some (transformers fills
them at random, differently at each load), and activations past the dtype's range (NaN logits)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchjob.engine import Engine
from batchjob.errors import ModelNotFoundError
from batchjob.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def _edited(tiny_model_dir, folder, edit):
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_checkpoint_without_a_weight_is_refused_for_generation_and_score(tiny_model_dir, tmp_path):
    folder = _edited(tiny_model_dir, tmp_path / "m", lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    for task in ("generate", "score"):
        with pytest.raises(
            ModelNotFoundError, match="its checkpoint has no model.layers.1.mlp.down_proj.weight"
        ):
            Engine.from_pretrained(str(folder), dtype="float64", task=task)


def test_logits_past_the_dtypes_range_are_the_rows_error(tiny_model_dir, tmp_path):
    """Tokens 100-109 get embeddings float16 holds (±65,000) that its MLP multiplies past its range: their
    rows' logits are NaN, which the draw took as the largest (token 0, an empty answer, finish 'length')."""

    def overflow(w):
        g = torch.Generator().manual_seed(0)
        embed = w["model.embed_tokens.weight"]
        embed[100:110] = torch.sign(torch.randn(10, embed.shape[1], generator=g)) * 65000.0
        w["model.layers.0.mlp.down_proj.weight"] *= 3e5

    folder = _edited(tiny_model_dir, tmp_path / "m", overflow)
    engine = Engine.from_pretrained(str(folder), dtype="float16", num_speculative_tokens=0)
    hot, cold = [[5, 100, 6, 7], [8, 104, 9]], [[5, 6, 7, 8], [9, 10, 11]]
    outs = engine.generate(hot + cold, GREEDY)
    for out in outs[:2]:
        assert (
            out.finish_reason == "error"
            and "logits are not finite (NaN or inf) at output token 1" in out.error
        )
    for out in outs[2:]:
        assert out.error is None and len(out.token_ids) == 4


def test_a_constrained_or_reported_row_with_some_logits_past_the_range_is_the_rows_error(
    tiny_model_dir, tmp_path
):
    """One output-head row made infinite: a constraint masks that token away, so the drawn token's logit is
    finite, but the row's log-probabilities (and each choice's) were NaN, written with error null."""

    def loud(w):
        w["lm_head.weight"][300] = float("inf")

    folder = _edited(tiny_model_dir, tmp_path / "m", loud)
    engine = Engine.from_pretrained(str(folder), dtype="float64", num_speculative_tokens=0)
    prompts = [[5, 6, 7], [8, 9]]
    for params in (
        SamplingParams(choices=["yes", "no"], temperature=0),
        SamplingParams(regex="[a-z]+", max_new_tokens=4, temperature=0),
        GREEDY.replace(logprobs=2, max_new_tokens=2),
    ):
        for out in engine.generate(prompts, params):
            assert out.finish_reason == "error" and "logits are not finite" in out.error, (params, out)
