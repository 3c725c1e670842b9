"""Tiny random models and a tokenizer trained in a second, saved to folders and loaded the normal way.

No downloads: the tokenizer is a byte-level BPE trained on a few sentences; the models are built from
``LlamaConfig`` (with grouped-query attention), ``Qwen2Config``, ``MistralConfig`` and ``GPT2Config`` with
random weights, and for the family matrix (:data:`FAMILIES`, :func:`make_family_model`) from the configs of
twenty-two more families, each with its distinctive features turned on.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "This product is great, I love it! Terrible quality, it broke after a day.",
    "Classify the sentiment of the review as positive, negative or neutral.",
    "Batch inference over a large dataset of prompts writes answers to Parquet files.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 { } [ ] : , \" ' ? !",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


WINDOW = 6  # the sliding attention window of the matrix's windowed families: shorter than their prompts
_ALTERNATE = ["sliding_attention", "full_attention"]  # layer 0 windowed, layer 1 full


def _family_configs() -> dict:
    """Config builders of the family matrix: each takes the shared ``common`` (tokenizer ids) and ``decoder``
    (tiny shape) settings and turns on what makes its family distinct."""
    import transformers as tf

    def no_ffn(d: dict) -> dict:  # for configs that name the MLP's width differently
        return {k: v for k, v in d.items() if k != "intermediate_size"}

    return {
        "mixtral": lambda c, d: tf.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, **d
        ),
        "qwen2_moe": lambda c, d: tf.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            **d,
        ),
        "qwen3": lambda c, d: tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **d),  # q/k norms
        "qwen3_moe": lambda c, d: tf.Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            **d,
        ),
        "gemma": lambda c, d: tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **d),  # tied head
        "gemma2": lambda c, d: tf.Gemma2Config(
            num_key_value_heads=2,
            head_dim=16,
            layer_types=_ALTERNATE,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **d,
        ),
        "gemma3_text": lambda c, d: tf.Gemma3TextConfig(  # q/k norms
            num_key_value_heads=2,
            head_dim=16,
            layer_types=_ALTERNATE,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            **d,
        ),
        "phi": lambda c, d: tf.PhiConfig(  # parallel attention and MLP, partial rotary, q/k layer norms
            qk_layernorm=True, partial_rotary_factor=0.5, **d
        ),
        "phi3": lambda c, d: tf.Phi3Config(
            num_key_value_heads=2, sliding_window=WINDOW, partial_rotary_factor=0.75, **d
        ),
        "olmo2": lambda c, d: tf.Olmo2Config(num_key_value_heads=2, **d),  # q/k norms
        "granite": lambda c, d: tf.GraniteConfig(
            num_key_value_heads=2,
            attention_multiplier=0.2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            logits_scaling=0.5,
            **d,
        ),
        "stablelm": lambda c, d: tf.StableLmConfig(
            num_key_value_heads=2,
            partial_rotary_factor=0.25,
            qk_layernorm=True,
            use_qkv_bias=True,
            use_parallel_residual=True,
            **d,
        ),
        "gpt_neox": lambda c, d: tf.GPTNeoXConfig(  # parallel residual, partial rotary
            use_parallel_residual=True, partial_rotary_factor=0.25, **d
        ),
        "opt": lambda c, d: tf.OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            word_embed_proj_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=1024,
            **c,
        ),
        "bloom": lambda c, d: tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **c),  # ALiBi
        "falcon": lambda c, d: tf.FalconConfig(  # the new decoder architecture, rotary, parallel attention
            new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=128, **no_ffn(d)
        ),
        "starcoder2": lambda c, d: tf.Starcoder2Config(num_key_value_heads=2, sliding_window=WINDOW, **d),
        "cohere": lambda c, d: tf.CohereConfig(  # parallel residual, q/k norms, logit scale
            num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5, **d
        ),
        # its logits multiplied by logits_scaling (Granite divides by it)
        "hyperclovax": lambda c, d: tf.HyperCLOVAXConfig(num_key_value_heads=2, logits_scaling=4.0, **d),
        # its layers drop the keyword arguments attention is given
        "nemotron": lambda c, d: tf.NemotronConfig(num_key_value_heads=2, partial_rotary_factor=0.5, **d),
        "smollm3": lambda c, d: tf.SmolLM3Config(  # layer 1 without rotary embeddings (NoPE)
            num_key_value_heads=2, no_rope_layers=[1, 0], **d
        ),
        "gpt_oss": lambda c, d: tf.GptOssConfig(  # attention sinks, alternating windows, MoE
            num_key_value_heads=2,
            head_dim=16,
            layer_types=_ALTERNATE,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            **no_ffn(d),
        ),
    }


_CONFIGS = _family_configs()

# The family matrix (tests/engine/test_families.py): the four families above plus every builder of _CONFIGS.
FAMILIES = ["llama", "mistral", "qwen2", "gpt2", *_CONFIGS]

# Larger random weights where the default initialisation leaves a family's answers nearly blind to their
# context, which would leave its attention untested (test_families checks that the context matters).
_INIT_RANGE = {
    "gpt2": 0.2,
    "gemma": 0.2,
    "granite": 0.2,
    "opt": 0.2,
    "bloom": 0.2,
    "falcon": 0.2,
    "smollm3": 0.2,
    "starcoder2": 0.1,
    "cohere": 0.1,
    "gpt_neox": 0.1,
    "stablelm": 0.05,
}


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """HF ``generate``'s greedy tokens after ``prompt``, on the model's device: the reference every exactness
    test compares with. ``ignore_eos``: run to ``max_new_tokens`` (the model's EOS ids are cleared)."""
    kwargs = {"eos_token_id": None, "pad_token_id": 0} if ignore_eos else {}
    if ignore_eos:
        hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def make_family_model(folder: Path, family: str, **kwargs):
    """A model of the family matrix: :func:`make_model` with weights large enough that answers depend on
    their context."""
    if family in _INIT_RANGE:
        kwargs.setdefault("initializer_range", _INIT_RANGE[family])
    return make_model(folder, family, **kwargs)


def make_model(
    folder: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    head_scale: float = 1.0,
    **overrides,
):
    """Build a tiny random ``family`` model, save it with a tokenizer to ``folder``.

    ``family``: llama | qwen2 | mistral | gpt2, or one of :data:`FAMILIES` (the family matrix).
    ``head_scale``: an untied output head is multiplied by it. The default, 1.0, is the random init as it
    comes: near-uniform logits whose top two can be within rounding of each other, as a real model's can.
    :func:`make_decisive_model` is the sharpened one, for the few tests that need decisive picks.
    """
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(folder, vocab_size)
    common = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # The decoder families share one tiny shape; each test only varies what makes the family distinct.
    decoder = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        **common,
    )
    if family == "llama":
        cfg = LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **decoder,
        )
    elif family == "qwen2":
        cfg = Qwen2Config(
            num_key_value_heads=1,
            **decoder,
        )
    elif family == "mistral":  # a sliding attention window shorter than the prompts
        cfg = MistralConfig(
            num_key_value_heads=2,
            sliding_window=6,
            **decoder,
        )
    elif family == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    elif family in _CONFIGS:
        cfg = _CONFIGS[family](common, decoder)
    else:
        raise ValueError(f"unknown family {family!r}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head is not None and not cfg.get_text_config().tie_word_embeddings and head_scale != 1.0:
            head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    return folder


DECISIVE_HEAD_SCALE = 8.0


def make_decisive_model(folder: Path, family: str = "llama", **kwargs):
    """:func:`make_model` with its untied output head ×8: peaked next-token distributions, so that sampled
    picks are nearly the greedy ones and a token's probability is far from its neighbours'. Only for tests
    that need decisive picks; the ordinary model is :func:`make_model`'s."""
    return make_model(folder, family, head_scale=DECISIVE_HEAD_SCALE, **kwargs)


def random_prompts(n_tokens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids 3.. (below are the specials), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in n_tokens]


def _one_layer_llama(tokenizer):
    """A one-layer Llama with every weight zero but the norms (one-hot embeddings then read as 8 * one-hot
    after the norm, attention and MLP outputs zero): its logits after a token are the head's column for the
    token's embedding slot, times 8."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.unk_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.zero_()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def make_scripted_model(folder: Path, tokenizer, chain: list[int]) -> Path:
    """A one-layer Llama whose greedy output after ``chain[i]`` is ``chain[i + 1]``, then EOS (one-hot
    embeddings, attention and MLP outputs zero, a head mapping slot i to the next token), saved to ``folder``
    with ``tokenizer``: for tests that need exact tokens from the real engine (a chain of at most 63)."""
    model = _one_layer_llama(tokenizer)
    seq = [*chain, tokenizer.eos_token_id]
    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for i, t in enumerate(seq[:-1]):
            emb[t, i] = 1.0
            head[seq[i + 1], i] = 10.0
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return Path(folder)


def make_bigram_model(folder: Path, tokenizer, logits: dict[int, dict[int, float]]) -> Path:
    """A one-layer Llama whose next token depends on the last one only: after token ``a`` the logit of ``b``
    is ``logits[a][b]`` and every other token's 0 (after a token not in ``logits``: all 0), saved to
    ``folder`` with ``tokenizer``: for tests that need a distribution set by hand (at most 64 keys)."""
    model = _one_layer_llama(tokenizer)
    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for slot, (a, row) in enumerate(logits.items()):
            emb[a, slot] = 1.0
            for b, value in row.items():
                head[b, slot] = value / 8
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return Path(folder)


def make_choice_bigram(folder: Path, after_a_c: float):
    """The bigram model of the choices tests, with its tokenizer, saved to ``folder``: after 'x', 'a' 0.5, 'b'
    0.3, 'd' 0.2; after 'a', 'c' ``after_a_c`` and 'd' the rest; after 'b', 'c', and after 'c', '!', each all
    but ~1e-41 (each to within ~1e-6: the other tokens share what the logit 20 leaves). Returns (tokenizer,
    the id of 'x')."""
    tok = make_tokenizer(folder)
    x, a, b, c, d, bang = (tok(s, add_special_tokens=False).input_ids[0] for s in "xabcd!")
    logits = {
        x: {a: 20 + math.log(0.5), b: 20 + math.log(0.3), d: 20 + math.log(0.2)},
        a: {c: 20 + math.log(after_a_c), d: 20 + math.log(1 - after_a_c)},
        b: {c: 100.0},
        c: {bang: 100.0},
    }
    make_bigram_model(folder, tok, logits)
    return tok, x
