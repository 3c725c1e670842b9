"""Tiny random models and a tokenizer trained in a second, saved to folders and loaded the normal way.

No downloads: the tokenizer is a byte-level BPE trained on a few sentences; the models are built from
``LlamaConfig`` (with grouped-query attention), ``Qwen2Config`` and ``GPT2Config`` with random weights.
"""

from __future__ import annotations

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


def make_model(folder: Path, family: str = "llama", *, seed: int = 0, vocab_size: int = 512, **overrides):
    """Build a tiny random ``family`` model (llama | qwen2 | mistral | gpt2), save it with a tokenizer to ``folder``."""
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
    else:
        raise ValueError(f"unknown family {family!r}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    # Random init gives near-uniform logits; scale the output head so greedy picks are decisive, which
    # keeps comparisons meaningful (a tie would make either engine's answer right).
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head is not None and not cfg.tie_word_embeddings:
            head.weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    return folder
