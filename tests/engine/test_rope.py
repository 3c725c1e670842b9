"""Rotary frequencies transformers picks per forward (engine/rope.py): each row gets the set HF ``generate``
gives it alone, whatever shares its step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PhimoeConfig

from batchjob import Engine, SamplingParams
from batchjob.engine import model_runner, rope
from batchjob.engine.config import EngineConfig
from batchjob.engine.plan import plan_model
from batchjob.errors import ConfigError
from tests.tiers import engine_fixture
from tests.tiny_models import hf_greedy, make_family_model, random_prompts

pytestmark = pytest.mark.timeout(180)

ORIGINAL, NEW = 16, 12  # longrope's switch, in tokens; generated tokens per row
# Prompts sharing their first 8 tokens (two blocks of 4): short ones that decode past the switch, long ones
# whose every token takes the long set. One engine step holds several; prefill chunks of 8 cut them.
LENGTHS = (5, 10, 20, 3, 30)


def _rope(kind: str) -> dict:
    if kind == "longrope":
        factors = {"short_factor": [1.0] * 6, "long_factor": [8.0] * 6, "partial_rotary_factor": 0.75}
        return {
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "original_max_position_embeddings": ORIGINAL,
            **factors,
        }
    return {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}


@engine_fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {
        "longrope": make_family_model(
            root / "phi3",
            "phi3",
            max_position_embeddings=128,
            rope_parameters=_rope("longrope"),
            original_max_position_embeddings=ORIGINAL,  # Phi3Config's own (4096) would replace the rope's
            sliding_window=None,
            initializer_range=0.1,
        ),
        # dynamic NTK grows past max_position_embeddings, which is the engine's context: never here
        "dynamic": make_family_model(
            root / "llama",
            "llama",
            max_position_embeddings=48,
            rope_parameters=_rope("dynamic"),
            initializer_range=0.1,
        ),
    }


def _prompts() -> list[list[int]]:
    shared = random_prompts([8], 400, seed=5)[0]
    return [
        (shared + p)[:n]
        for n, p in zip(LENGTHS, random_prompts([30] * len(LENGTHS), 400, seed=6), strict=True)
    ]


def _run(path, **options) -> list[list[int]]:
    engine = Engine.from_pretrained(
        str(path),
        dtype="float64",
        device="cpu",
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        num_blocks=40,
        enable_prefix_caching=True,
        **options,
    )
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(_prompts(), params)]


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_each_row_takes_the_frequencies_hf_gives_it_alone(models, kind):
    hf = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float64).eval()
    want = [hf_greedy(hf, p, NEW) for p in _prompts()]
    assert _run(models[kind]) == want


def test_the_long_set_changes_the_answers(models, monkeypatch):
    """Both sets matter for this model, and without the per-row choice a long row in the step moves its
    neighbours to the long set: the test above would fail."""
    hf = AutoModelForCausalLM.from_pretrained(models["longrope"], dtype=torch.float64).eval()
    short = [hf_greedy(hf, p, NEW) for p in _prompts()]
    hf.config.rope_parameters["original_max_position_embeddings"] = 1  # every forward takes the long set
    changed = [a != hf_greedy(hf, p, NEW) for p, a in zip(_prompts(), short, strict=True)]
    assert changed == [n <= ORIGINAL for n in LENGTHS]  # every row that starts short
    monkeypatch.setattr(model_runner.LongRope, "install", classmethod(lambda cls, *a: None))
    assert _run(models["longrope"]) != short


def test_a_context_within_the_switch_needs_no_choice_and_the_others_are_refused(models):
    path = models["longrope"]
    engine = Engine.from_pretrained(str(path), dtype="float64", device="cpu", max_model_len=ORIGINAL)
    assert engine.runner.rope is None
    cpu = torch.device("cpu")
    cap = f"cap the context with --max-model-len {ORIGINAL}"
    # Phi-3.5-MoE's rotary module scales by the whole forward's length; a Llama with longrope switches
    # mid-row in generate: both refused past the switch, run within it
    moe_rope = {**_rope("longrope"), "short_mscale": 1.0, "long_mscale": 1.2, "partial_rotary_factor": 1.0}
    for config in (
        PhimoeConfig(max_position_embeddings=128, rope_parameters=moe_rope),
        LlamaConfig(max_position_embeddings=128, rope_parameters=_rope("longrope")),
    ):
        with pytest.raises(ConfigError, match=f"does not follow per row; {cap}"):
            plan_model(config, EngineConfig(cpu, torch.float64))
        plan_model(config, EngineConfig(cpu, torch.float64, max_model_len=ORIGINAL))
    # tensor-parallel ranks receive no per-row set (Phi-3's family does not split today: checked first)
    with pytest.raises(ConfigError, match=f"without tensor parallelism; {cap}"):
        rope.check(AutoConfig.from_pretrained(path), 128, sharded=True)
