"""Write a model with random weights at the shape of a real one, with a tokenizer.

For benchmarks where nothing can be downloaded: the shapes of a 0.5B or 1.5B model, the speed of one, no
meaning. The tokenizer is the default model's (SmolLM2's, 49,152 tokens), or with ``--tokenizer trained`` a
small byte-level BPE trained here in a second (tests/tiny_models.py), for a machine without the default
model's package (the GPU check); the embedding keeps the real model's vocabulary size either way, so the
output head costs what it costs there. The Qwen2.5 shapes are written as Llama models (see ``config_for``);
``tiny`` is a toy shape for rehearsing a script on the CPU.

    python measurements/gpu/random_model.py /tmp/random-0.5b                     # Llama-shaped, ~0.5B
    python measurements/gpu/random_model.py /tmp/qwen2.5-1.5b qwen2.5-1.5b       # Qwen2.5-1.5B's config
    python measurements/gpu/random_model.py /tmp/q qwen2.5-0.5b --tokenizer trained   # nothing installed
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

QWEN25 = {  # the published configs' shapes (hidden, intermediate, layers, heads, KV heads)
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
}


SHAPES = ("llama-0.5b", *QWEN25, "tiny")


def config_for(shape: str, vocab_size: int):
    if shape == "tiny":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
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


def _tokenizer(kind: str, out: str):
    if kind == "trained":
        from pathlib import Path

        from tests.tiny_models import make_tokenizer  # the repository root on the path (PYTHONPATH)

        return make_tokenizer(Path(out), vocab_size=1024)
    from batchjob.models import resolve_model  # the default model's package

    return AutoTokenizer.from_pretrained(resolve_model(None))


def main(out: str, shape: str = "llama-0.5b", tokenizer_kind: str = "default") -> None:
    if shape not in SHAPES:
        sys.exit(f"unknown shape {shape!r}: {', '.join(SHAPES)}")
    tokenizer = _tokenizer(tokenizer_kind, out)
    # the Llama shape's vocabulary is the default tokenizer's (SmolLM2's 49,152), trained tokenizer or not
    vocab_size = 49152 if shape == "llama-0.5b" else len(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(shape, vocab_size), dtype=torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the folder to write the model into")
    ap.add_argument(
        "shape", nargs="?", default="llama-0.5b", help=f"one of {', '.join(SHAPES)} (default llama-0.5b)"
    )
    ap.add_argument(
        "--tokenizer",
        choices=["default", "trained"],
        default="default",
        help="the default model's tokenizer, or a small one trained here (no package needed)",
    )
    args = ap.parse_args()
    main(args.out, args.shape, args.tokenizer)
