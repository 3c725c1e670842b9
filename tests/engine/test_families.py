"""The family matrix: each model family either matches Hugging Face ``generate`` token for token, or is refused
at load with an error that names the family and the feature. Never a silent mismatch, never a crash mid-run.

Every family runs under the same pressure: prompts longer than the sliding windows, a token budget that chunks
every prompt, a KV pool small enough to force preemptions, and prefix caching with a prompt prefix shared by
all requests. Tiny random models (hidden 64, 2 layers: a windowed and a full layer where a family alternates),
float64 for all of them, MoE ones included (the engine runs transformers' experts eagerly in float64, as the
reference does here). The models are the ordinary random ones (no sharpened head), whose top two logits can
be near-ties: float64 is exact all the same, and ``test_unscaled_head_in_float32_differs_only_at_near_ties``
shows what holds in float32.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from batchjob import Engine, SamplingParams
from batchjob.engine import model_runner, support
from batchjob.engine import plan as plan_module
from batchjob.engine.attention.flex import Flex
from batchjob.engine.attention.registry import supported_features
from batchjob.engine.config import EngineConfig
from batchjob.errors import ConfigError
from tests.tiers import engine_fixture
from tests.tiny_models import FAMILIES, hf_greedy, make_family_model

pytestmark = pytest.mark.timeout(120)


# Refused families and the feature names their refusal must carry. A backend that computes one of these
# features exactly (a backend's ``computes``) must move the family out of here: the matrix then checks it
# is exact.
def _calls_attention_interface(model_type: str) -> bool:
    """Whether this transformers' class for the family calls the attention interface (Falcon does from 5.25)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type)
    return support._own_attention(config, None) is None


OWN_ATTENTION = {"own_attention": "computes attention inside its own layers"}
REFUSED = {"bloom": {**OWN_ATTENTION, "alibi": "ALiBi"}}
if not _calls_attention_interface("falcon"):
    REFUSED["falcon"] = OWN_ATTENTION
# Families whose attention only the flex backend computes (the feature it needs): the engine picks it.
NEED_FLEX = {"gemma2": "softcap", "gpt_oss": "sinks"}
# Families without a full-attention layer: tokens beyond the window cannot change their answers.
WINDOWED_EVERYWHERE = {"mistral", "mixtral", "phi3", "starcoder2"}

BLOCK, BUDGET, SEQS, NUM_BLOCKS = 4, 8, 4, 12
PREFIX, SUFFIXES, NEW = 12, (5, 14, 9, 18), 6  # prompts of 17..30 tokens, all longer than the window of 6


@engine_fixture(scope="module")
def folder(tmp_path_factory):
    """The saved model of a family, built once per module."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, object] = {}

    def get(family: str, **kwargs):
        key = family + repr(sorted(kwargs.items()))
        if key not in built:
            built[key] = make_family_model(root / f"{family}-{len(built)}", family, **kwargs)
        return built[key]

    return get


def _engine_options():
    return dict(
        device="cpu",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=SEQS,
        num_blocks=NUM_BLOCKS,
        enable_prefix_caching=True,
    )


def _reference(path, dtype=torch.float64, **options):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager", **options
    ).eval()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in SUFFIXES]


def _generate(engine, prompts, max_new_tokens: int = NEW) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _flips(hf, prompt: list[int], changed: range, seen: slice, rng: random.Random) -> int:
    """Positions of ``seen`` whose greedy pick changes when the tokens at ``changed`` are replaced."""
    other = list(prompt)
    for i in changed:
        other[i] = rng.randrange(3, hf.config.get_text_config().vocab_size)
    with torch.inference_mode():
        a = hf(torch.tensor([prompt])).logits[0, seen].argmax(-1)
        b = hf(torch.tensor([other])).logits[0, seen].argmax(-1)
    return int((a != b).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_generate_or_is_refused(folder, family, decode_path):
    """``decode_path``: decode attention by the compiled CPU kernel, then by the torch reference."""
    path = folder(family)
    config = AutoConfig.from_pretrained(path)
    if family in REFUSED:
        with pytest.raises(ConfigError) as err:
            Engine.from_pretrained(str(path), dtype="float64", **_engine_options())
        message = str(err.value)
        assert f"model family '{config.model_type}'" in message and "refused" in message
        for words in REFUSED[family].values():
            assert words in message
        # The config alone (what `batchjob validate` has) finds the same features.
        assert {name for name, _ in support.unsupported_features(config)} == set(REFUSED[family])
        return

    assert support.unsupported_features(config) == []
    engine = Engine.from_pretrained(str(path), dtype="float64", **_engine_options())
    if family in NEED_FLEX:
        assert engine.runner.attention.name == "flex" and NEED_FLEX[family] in engine.runner.features
    else:
        assert (engine.runner.attention.name == "cpu_kernel") == (decode_path == "kernel")
    hf = _reference(path)
    prompts = _prompts(engine.vocab_size)
    outs = _generate(engine, prompts)
    for p, toks in zip(prompts, outs, strict=True):
        assert toks == hf_greedy(hf, p, NEW), f"{family}: prompt of {len(p)} tokens"
    stats = engine.stats
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0, stats
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    # The answers depend on the context, so the comparison above really tests attention: replacing four
    # prompt tokens changes later greedy picks (within the window), and so does replacing the first eight
    # (beyond the window) where a layer attends to everything.
    rng = random.Random(1)
    assert sum(_flips(hf, p, range(10, 14), slice(14, 20), rng) for p in prompts[1:]) > 0, family
    if family not in WINDOWED_EVERYWHERE:
        assert sum(_flips(hf, p, range(0, 8), slice(20, None), rng) for p in prompts[1:]) > 0, family


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_families_would_answer_wrongly(folder, family, monkeypatch):
    """Without the refusal, each refused family runs and silently answers differently from HF."""
    path = folder(family)
    hf = _reference(path)
    model = copy.deepcopy(hf)
    monkeypatch.setattr(plan_module, "check_supported", lambda *a, **k: None)
    monkeypatch.setattr(plan_module, "attention_features", lambda *a: frozenset())  # the plan's choice
    monkeypatch.setattr(model_runner, "attention_features", lambda *a: frozenset())  # nor the backend choice
    options = _engine_options()
    config = EngineConfig(torch.device(options.pop("device")), torch.float64, **options)
    engine = Engine(model, AutoTokenizer.from_pretrained(path), config)
    prompts = _prompts(engine.vocab_size)
    outs = _generate(engine, prompts)
    wrong = sum(toks != hf_greedy(hf, p, NEW) for p, toks in zip(prompts, outs, strict=True))
    assert wrong > 0, f"{family}: every answer matched; the refusal would be needless"


@pytest.mark.parametrize("family", sorted(NEED_FLEX))
def test_what_only_flex_computes_changes_the_answers(folder, family):
    """The feature flex is chosen for matters: HF without it answers differently, so a backend ignoring it would
    be silently wrong (the others refuse such a model: test_flex), and with it the engine equals HF."""
    path = folder(family)
    # eager: some transformers versions (5.17) load Gemma-2 with SDPA, which drops the soft-cap without a word
    hf = _reference(path, attn_implementation="eager")
    with torch.no_grad():
        for layer in hf.model.layers:
            if family == "gemma2":
                # Soft-capping at 50 barely touches a tiny random model's attention logits (about 0.01):
                # sharpen the queries and keys and cap at 1 so that applying it or not changes the answers.
                layer.self_attn.q_proj.weight.mul_(10.0)
                layer.self_attn.k_proj.weight.mul_(10.0)
                layer.self_attn.attn_logit_softcapping = 1.0
            else:
                layer.self_attn.sinks.mul_(0.0).add_(4.0)  # a sink that takes a good share of each softmax
    without = copy.deepcopy(hf)
    for layer in without.model.layers:
        if family == "gemma2":
            layer.self_attn.attn_logit_softcapping = None
        else:
            layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) is 0: no sink
    options = _engine_options()
    config = EngineConfig(torch.device(options.pop("device")), torch.float64, **options)
    engine = Engine(copy.deepcopy(hf), AutoTokenizer.from_pretrained(path), config)
    assert engine.runner.attention.name == "flex"
    prompts = _prompts(engine.vocab_size)
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    assert _generate(engine, prompts) == refs
    assert sum(hf_greedy(without, p, NEW) != ref for p, ref in zip(prompts, refs, strict=True)) > 0


def test_unscaled_head_is_exact_in_float64(folder, capsys):
    """The ordinary head (no sharpening), whose picks can meet near-ties: float64 is still exact."""
    path = folder("llama")
    engine = Engine.from_pretrained(str(path), dtype="float64", **_engine_options())
    hf = _reference(path)
    prompts = _prompts(engine.vocab_size, seed=3)
    outs = _generate(engine, prompts, max_new_tokens=10)
    refs = [hf_greedy(hf, p, 10) for p in prompts]
    with torch.inference_mode():
        top2 = hf(torch.tensor([prompts[0]])).logits[0].topk(2, -1).values
    margin = float((top2[:, 0] - top2[:, 1]).median())
    same = sum(a == b for out, ref in zip(outs, refs, strict=True) for a, b in zip(out, ref, strict=True))
    with capsys.disabled():
        print(
            f"\nunscaled llama head, float64: {same}/{sum(map(len, refs))} tokens agree with HF generate "
            f"(median top-1/top-2 logit margin {margin:.3f})"
        )
    assert outs == refs


def test_unscaled_head_in_float32_differs_only_at_near_ties(folder, capsys):
    """What holds in float32: equal to HF ``generate`` up to float rounding. Our float32 path rounds
    differently (packed CPU linears, the decode kernel, SDPA per chunk), so two logits within rounding of each
    other may be picked differently; every sequence must agree with HF up to its first difference, and that
    difference must fall on a near-tie of HF's own logits (top-1 and top-2 within 1e-4). The agreement rate is
    measured and printed."""
    path = folder("llama")
    options = _engine_options() | {"num_blocks": 64}
    engine = Engine.from_pretrained(str(path), dtype="float32", **options)
    hf = _reference(path, torch.float32)
    prompts = [p for seed in range(4) for p in _prompts(engine.vocab_size, seed=seed)]
    outs = _generate(engine, prompts, max_new_tokens=16)
    same = total = diverged = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf, prompt, 16)
        total += len(ref)
        first = next((i for i, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b), None)
        same += len(ref) if first is None else first
        if first is None:
            continue
        diverged += 1
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ref[:first]])).logits[0, -1]
        top2 = logits.topk(2)
        assert float(top2.values[0] - top2.values[1]) < 1e-4, (prompt, first, top2)
        assert out[first] in top2.indices.tolist()
    with capsys.disabled():
        print(
            f"\nunscaled llama head, float32: {same}/{total} tokens agree with HF generate before any first "
            f"difference; {diverged}/{len(prompts)} sequences differ, each from a near-tie"
        )
    assert same > 0


# -- the support table, from configs alone ---------------------------------------------------------------


def _configs():
    import transformers as tf

    return {
        # What our attention honours is never refused: windows per layer, scaling overrides, final soft-capping.
        "gemma2 without attention soft-capping": (tf.Gemma2Config(attn_logit_softcapping=None), set()),
        "gemma3 (final soft-capping, windows)": (tf.Gemma3TextConfig(final_logit_softcapping=30.0), set()),
        "granite attention_multiplier": (tf.GraniteConfig(attention_multiplier=0.1), set()),
        "mistral window": (tf.MistralConfig(sliding_window=4), set()),
        "stablelm": (tf.StableLmConfig(), set()),
        "falcon with alibi": (tf.FalconConfig(alibi=True), {"alibi"} | set(REFUSED.get("falcon", ()))),
        "mpt": (tf.MptConfig(), {"own_attention", "alibi"}),
        # EmbeddingGemma: a window both ways, which the torch and cpu backends compute (test_tasks.py)
        "bidirectional gemma3": (tf.Gemma3TextConfig(use_bidirectional_attention=True), set()),
        # a window both ways in a family whose bounds are not checked: refused, not guessed
        "bidirectional windowed qwen2": (
            tf.Qwen2Config(use_bidirectional_attention=True, use_sliding_window=True, sliding_window=128),
            {"unchecked_window"},
        ),
        "llama4 chunked attention": (tf.Llama4TextConfig(), {"layer_types"}),
        # layers that write keys and values of another shape than the cache's: multi-head latent attention,
        # JetMoE's heads repeated by top_k (the first token matched HF, every decoded one after it did not)
        "deepseek_v3 latent attention": (tf.DeepseekV3Config(), {"kv_shape"}),
        "deepseek_v2 latent attention": (tf.DeepseekV2Config(), {"kv_shape"}),
        "jetmoe": (tf.JetMoeConfig(), {"kv_shape"}),
        # a window only in the mask transformers builds (ours applies each layer's sliding_window), a learned
        # mask, two calls per layer, layers run in cycles
        "qwen2_moe window": (tf.Qwen2MoeConfig(use_sliding_window=True, sliding_window=6), {"unusual_calls"}),
        "qwen2_moe without a window": (tf.Qwen2MoeConfig(), set()),
        "phimoe window": (tf.PhimoeConfig(sliding_window=6), {"unusual_calls"}),
        "phimoe window of its context": (
            tf.PhimoeConfig(sliding_window=4096, max_position_embeddings=4096),
            set(),
        ),
        "doge": (tf.DogeConfig(), {"unusual_calls"}),
        "diffllama": (tf.DiffLlamaConfig(), {"unusual_calls"}),
        "hrm_text": (tf.HrmTextConfig(), {"unusual_calls"}),
    }


@pytest.mark.parametrize("case", list(_configs()))
def test_unsupported_features_from_config(case):
    config, expected = _configs()[case]
    assert {name for name, _ in support.unsupported_features(config)} == expected
    if expected:
        with pytest.raises(ConfigError, match=f"model family '{config.model_type}'"):
            support.check_supported(config)
    else:
        support.check_supported(config)


def test_features_only_flex_computes_are_refused_without_it():
    """Soft-capping and sinks are found from the config alone; with flex's features they pass, without they are
    refused by family and feature."""
    import transformers as tf

    for config, feature in ((tf.Gemma2Config(), "softcap"), (tf.GptOssConfig(), "sinks")):
        assert feature in support.attention_features(config)
        assert feature in Flex.computes
        support.check_supported(config)
        without = supported_features() - {feature}
        assert [name for name, _ in support.unsupported_features(config, None, without)] == [feature]
        with pytest.raises(ConfigError, match=f"model family '{config.model_type}'"):
            support.check_supported(config, None, without)


def test_validate_and_run_refuse_a_family_before_any_work(folder, tmp_path):
    from click.testing import CliRunner

    from batchjob.cli import main

    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "hello"}\n')
    for command in ("validate", "run"):
        out = tmp_path / command
        args = [
            command,
            "--input",
            str(data),
            "--output",
            str(out),
            "--model",
            str(folder("bloom")),
            "--no-chat",
        ]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "model family 'bloom'" in result.output, result.output
        assert not list(out.glob("*.parquet"))


@pytest.mark.engine
def test_keys_of_another_shape_than_the_cache_are_refused_at_the_first_forward(tmp_path, monkeypatch):
    """The KV cache is planned from the config; a family whose layers write keys of another shape (DeepSeek's
    latent attention, refused by config above) would have its decode read mangled keys: the write refuses it."""
    import transformers as tf

    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer(tmp_path)
    mla = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    moe = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    config = tf.DeepseekV3Config(vocab_size=len(tok), num_key_value_heads=2, **shape, **mla, **moe)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    monkeypatch.setattr(plan_module, "check_supported", lambda *a, **k: None)  # let it through to its forward
    monkeypatch.setattr(plan_module, "attention_features", lambda *a: frozenset())
    monkeypatch.setattr(model_runner, "attention_features", lambda *a: frozenset())
    engine = Engine.from_pretrained(str(tmp_path), dtype="float64", device="cpu")
    with pytest.raises(ConfigError, match="writes keys of 4 heads x 16 .* KV cache of 2 x 8"):
        _generate(engine, [[5, 6, 7, 8]], max_new_tokens=2)


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma3_text", "hyperclovax"])
def test_score_applies_each_familys_logit_transform_as_its_forward_does(folder, family):
    """score computes logits with its own head (engine/tasks/runner.py): Granite divides by logits_scaling,
    HyperCLOVA X multiplies by it (the way was once taken for Granite's), Cohere scales, Gemma-3 caps."""
    path = folder(family)
    hf = _reference(path)
    engine = Engine.from_pretrained(str(path), task="score", device="cpu", dtype="float64")
    ids = _prompts(engine.vocab_size)[0]
    out = engine.score([ids], token_logprobs=True)[0]
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    want = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(out.token_logprobs, dtype=torch.float64), want, rtol=0, atol=1e-10)
