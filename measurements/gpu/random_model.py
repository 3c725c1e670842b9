"""Write a model with random weights at the shape of a real one (and the default model's tokenizer).

For benchmarks where nothing can be downloaded: the shapes of a 0.5B or 1.5B model, the speed of one, no
meaning. The tokenizer is SmolLM2's (49,152 tokens); the embedding keeps the real model's vocabulary size.
The Qwen2.5 shapes are written as Llama models (see ``config_for``).

    python measurements/gpu/random_model.py /tmp/random-0.5b                     # Llama-shaped, ~0.5B
    python measurements/gpu/random_model.py /tmp/qwen2.5-1.5b qwen2.5-1.5b       # Qwen2.5-1.5B's config
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from batchjob.models import resolve_model

QWEN25 = {  # the published configs' shapes (hidden, intermediate, layers, heads, KV heads)
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
}


def config_for(shape: str, vocab_size: int):
    if shape == "llama-0.5b":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    hidden, inter, layers, heads, kv = QWEN25[shape]
    # Llama's architecture at Qwen2.5's shapes (vocabulary included): the same GEMMs and attention, less
    # Qwen2's small q/k/v biases. llama.cpp's converter takes it with the default model's tokenizer, which
    # it does not recognise under Qwen2's own architecture.
    return LlamaConfig(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def main(out: str, shape: str = "llama-0.5b") -> None:
    if shape != "llama-0.5b" and shape not in QWEN25:
        sys.exit(f"unknown shape {shape!r}: llama-0.5b, {', '.join(QWEN25)}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(shape, len(tokenizer)), dtype=torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the folder to write the model into")
    ap.add_argument("shape", nargs="?", default="llama-0.5b", help="llama-0.5b (default), qwen2.5-0.5b or qwen2.5-1.5b")
    args = ap.parse_args()
    main(args.out, args.shape)
