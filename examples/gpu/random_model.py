"""Write a ~0.5B-parameter Llama-shaped model with random weights (and the default model's tokenizer).

For GPU benchmarks where nothing can be downloaded: the shapes of a 0.5B model, the speed of one, no meaning.

    python examples/gpu/random_model.py /tmp/random-0.5b
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from batchjob.models import resolve_model


def main(out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])
