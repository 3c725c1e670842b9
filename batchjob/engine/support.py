"""The attention features a model needs, found from its config (and modules), and the refusal at load of those
no attention backend computes exactly.

The engine runs unmodified Hugging Face models and replaces only their attention (see :mod:`attention`). A
model whose attention needs something our attention function does not apply would run without an error and
answer wrongly, so such a model is refused when the engine is built, naming its family and the feature.

What our attention honours, so nothing here refuses it: the ``scaling`` each layer passes (Granite's
``attention_multiplier``, Gemma's ``query_pre_attn_scalar``, OPT's pre-scaled queries), the ``sliding_window``
each layer passes (Mistral, Phi-3, Starcoder2; per layer in Gemma-2/3, Qwen2/3, SmolLM3, gpt-oss), grouped
queries. What the model computes itself is not our concern: rotary embeddings (partial or none: Phi,
StableLM, GPT-NeoX; SmolLM3's NoPE layers), q/k norms, parallel residuals, MoE routing, and final logit
soft-capping and logit scales (Gemma-2/3, Cohere, Granite apply them in their own forward, after the head).

Soft-capping and sinks are computed by the flex backend, which the engine then picks (see
:func:`batchjob.engine.attention.registry.choose_attention`); what each backend computes is declared by its
class (``computes``), and a feature no backend computes is refused here, by family and feature.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from batchjob.engine.attention.registry import supported_features
from batchjob.engine.vision.family import image_both_ways
from batchjob.errors import ConfigError


@dataclass(frozen=True)
class Feature:
    name: str  # the name a backend's ``computes`` lists when it computes it
    uses: str  # what the model does, as the refusal says it: "uses attention logit soft-capping"
    consequence: str  # why that is wrong here: "which batchjob's attention does not apply yet"
    detect: Callable[[Any, Any], str | None]  # (text config, model or None) -> detail, None: not used


def _model_class(config, model):
    """The model's class, else the class transformers would build for this config (None if it has none)."""
    if model is not None:
        return type(model)
    from transformers import AutoModelForCausalLM  # heavy: only for a config without its model

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def _own_attention(config, model) -> str | None:
    # transformers' own test (private, hence looked up): does the class's module call the attention interface?
    cls = _model_class(config, model)
    uses_interface = getattr(cls, "_can_set_attn_implementation", None)
    if cls is None or uses_interface is None or uses_interface():
        return None
    return f"{cls.__name__} does not call transformers' attention interface"


def _softcap(config, model) -> str | None:
    # Refused whenever set: Gemma-2 passes it to attention; a family that stores it without applying it (Gemma-3
    # in transformers 5.x) has it unset in its released checkpoints, so erring towards refusal costs nothing.
    cap = getattr(config, "attn_logit_softcapping", None)
    return None if cap is None else f"attn_logit_softcapping={cap}"


def _alibi(config, model) -> str | None:
    if config.model_type == "bloom":
        return "in every Bloom layer"
    for name in ("alibi", "use_alibi"):
        if getattr(config, name, False) is True:
            return f"{name}=True"
    if getattr(getattr(config, "attn_config", None), "alibi", False) is True:  # MPT
        return "attn_config.alibi=True"
    if getattr(config, "position_embedding_type", None) == "alibi":
        return "position_embedding_type='alibi'"
    return None


# Families whose attention layers add a learned sink logit per head (``s_aux``) in transformers 5.x; with a
# model at hand, its modules decide.
_SINK_FAMILIES = {
    "gpt_oss",
    "granite_swa",
    "granitemoe_swa",
    "mimo_v2_flash",
    "flint",
    "hy_v4",
    "deepseek_v4",
}


def _sinks(config, model) -> str | None:
    if model is None:
        return "a learned sink logit per head" if config.model_type in _SINK_FAMILIES else None
    layers = [m for m in model.modules() if getattr(m, "sinks", None) is not None]
    return f"a learned sink logit per head in {len(layers)} layers" if layers else None


# Encoder families (attention within a row both ways) as their config alone tells; with a model at hand its
# attention modules decide (``is_causal`` False).
_ENCODER_FAMILIES = {"bert", "roberta", "xlm-roberta", "camembert", "modernbert", "distilbert", "electra"}


def _bidirectional(config, model) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True"
    if model is not None:
        layers = [
            m
            for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "is_causal")
        ]
        if layers and all(m.is_causal is False for m in layers):
            return f"an encoder: {type(layers[0]).__name__}.is_causal is False"
        if layers:
            return None
    if config.model_type in _ENCODER_FAMILIES and not getattr(config, "is_decoder", False):
        return f"an encoder ({config.model_type})"
    return None


def _bidirectional_window(config, model) -> str | None:
    window = getattr(config, "sliding_window", None) or getattr(config, "local_attention", None)
    if window and _bidirectional(config, model) is not None:
        return f"a window both ways ({window} tokens)"
    return None


# Families whose window both ways is checked to be what our backends compute, ``|q - k| < w`` for the window
# ``w`` each layer passes (ModernBERT passes its half window + 1 with an inclusive mask, Gemma-3 its window
# with an exclusive one: the same keys). Another family's bounds may differ by one: refused until checked.
_WINDOW_BOTH_WAYS_CHECKED = {"modernbert", "gemma3_text", "gemma3"}


def _unchecked_window(config, model) -> str | None:
    detail = _bidirectional_window(config, model)
    if detail is None or config.model_type in _WINDOW_BOTH_WAYS_CHECKED:
        return None
    return f"{detail}, in a family whose window bounds batchjob has not checked against its own mask"


def _kv_shape(config, model) -> str | None:
    # The KV cache holds num_key_value_heads x head_dim per token; these families' layers write others:
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-Lite: keys of qk_nope + qk_rope dims per
    # query head), JetMoE (its KV heads repeated by top_k).
    if getattr(config, "kv_lora_rank", None) is not None:
        return f"multi-head latent attention (kv_lora_rank={config.kv_lora_rank})"
    if config.model_type == "jetmoe":
        return "its key and value heads repeated by the experts per token"
    return None


# Families whose layers call attention in ways our paged attention does not follow: Doge's learned dynamic
# mask (passed as the attention mask, which ours leaves aside), DiffLlama's two calls per layer over one cache,
# HRM's layers run in cycles (each cached at another index than its layer_idx).
_UNUSUAL_CALLS = {
    "doge": "a learned dynamic attention mask",
    "diffllama": "two attention calls per layer",
    "hrm_text": "layers that run several times a forward",
}
# Families whose window reaches attention only through the mask transformers builds, not as each layer's
# ``sliding_window`` (the one our attention applies).
_WINDOW_IN_MASK = {"qwen2_moe", "phimoe", "blt"}


def _unusual_calls(config, model) -> str | None:
    if config.model_type in _UNUSUAL_CALLS:
        return _UNUSUAL_CALLS[config.model_type]
    window = getattr(config, "sliding_window", None) or 0
    context = getattr(config, "max_position_embeddings", None) or 0
    active = getattr(config, "use_sliding_window", True) and 0 < window < context
    if config.model_type in _WINDOW_IN_MASK and active:
        return f"a sliding window of {window} tokens applied only through its attention mask"
    return None


_KNOWN_LAYER_TYPES = {"full_attention", "sliding_attention"}


def _other_layer_types(config, model) -> str | None:
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _KNOWN_LAYER_TYPES)
    return None if not other else "layer_types include " + ", ".join(repr(t) for t in other)


FEATURES: tuple[Feature, ...] = (
    Feature(
        "own_attention",
        "computes attention inside its own layers",
        "so batchjob's paged attention is never called",
        _own_attention,
    ),
    Feature(
        "softcap",
        "uses attention logit soft-capping",
        "which no attention backend of batchjob applies",
        _softcap,
    ),
    Feature("alibi", "uses ALiBi position biases", "which no attention backend of batchjob applies", _alibi),
    Feature("sinks", "uses attention sinks", "which no attention backend of batchjob applies", _sinks),
    Feature(
        "bidirectional",
        "uses bidirectional attention",
        "which only the torch, cpu and flex attention backends compute (for embed and classify)",
        _bidirectional,
    ),
    Feature(
        "bidirectional_window",
        "uses windowed attention both ways",
        "which only the torch and cpu attention backends compute (for embed and classify)",
        _bidirectional_window,
    ),
    Feature(
        "unchecked_window",
        "uses windowed attention both ways",
        "whose bounds batchjob has checked only for ModernBERT and Gemma-3 (it would risk an off-by-one window)",
        _unchecked_window,
    ),
    Feature(
        "kv_shape",
        "caches keys and values of another shape than num_key_value_heads x head_dim",
        "which batchjob's KV cache does not hold",
        _kv_shape,
    ),
    Feature(
        "unusual_calls",
        "calls attention in its own way",
        "which batchjob's paged attention does not follow",
        _unusual_calls,
    ),
    Feature(
        "layer_types",
        "has attention layers that are neither full nor sliding-window",
        "which batchjob's attention does not compute",
        _other_layer_types,
    ),
)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_features(config, model=None) -> list[tuple[str, str]]:
    """(feature name, detail) for each feature of :data:`FEATURES` the model uses, ``sliding_window``, and
    ``image_both_ways`` (a vision-language model whose image tokens attend both ways within an image).

    ``config`` is the model's config; ``model``, when given, is looked at too (its class and modules), which
    is exact where the config alone only knows the families of this transformers version.
    """
    text = _text_config(config)
    found = [(f.name, detail) for f in FEATURES if (detail := f.detect(text, model)) is not None]
    window = getattr(text, "sliding_window", None)
    if window:
        found.append(("sliding_window", f"sliding_window={window}"))
    both_ways = image_both_ways(config)
    if both_ways:
        found.append(("image_both_ways", both_ways))
    return found


def attention_features(config, model=None) -> frozenset[str]:
    """The attention features a model needs beyond plain causal attention: ``sliding_window``, ``softcap``
    (attention logit soft-capping), ``sinks`` (a learned sink logit per head), ``alibi``, and those no
    backend has (``own_attention``, ``bidirectional``, ...)."""
    return frozenset(name for name, _ in model_features(config, model))


def supported() -> frozenset[str]:
    """The features some attention backend computes exactly."""
    return supported_features()


def unsupported_features(
    config, model=None, supported_features: Collection[str] | None = None
) -> list[tuple[str, str]]:
    """(feature name, detail) for each feature of the model that no attention backend computes exactly
    (``supported_features``: those that are computed, default :func:`supported`)."""
    computed = supported() if supported_features is None else supported_features
    return [(name, detail) for name, detail in model_features(config, model) if name not in computed]


def check_supported(config, model=None, supported_features: Collection[str] | None = None) -> None:
    """Raise ``ConfigError`` naming the family and each feature when the model would get wrong answers."""
    found = unsupported_features(config, model, supported_features)
    if not found:
        return
    features = {f.name: f for f in FEATURES}
    reasons = "; and ".join(
        f"{features[name].uses} ({detail}), {features[name].consequence}" for name, detail in found
    )
    family = getattr(config, "model_type", None) or type(config).__name__
    raise ConfigError(f"model family {family!r} {reasons}; it would give wrong answers, so it is refused")
