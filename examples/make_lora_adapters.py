"""Build three random LoRA adapters for the embedded default model, in PEFT's folder format, for
``jobs/lora.toml`` (nothing can be downloaded, so their weights are random: each changes the answers, none
is trained).

    python examples/make_lora_adapters.py [OUT_DIR]     # default: out/lora_adapters

Each folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, as PEFT's ``save_pretrained``
writes them; peft itself is not needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from batchjob.models import resolve_model

# name -> (rank, alpha, target modules, seed)
ADAPTERS = {
    "formal": (8, 16, ["q_proj", "v_proj"], 1),
    "terse": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 2),
    "pirate": (8, 32, ["gate_proj", "up_proj", "down_proj"], 3),
}


def shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of a Llama-shaped model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(folder: Path, base: str, config, rank: int, alpha: int, targets: list[str], seed: int) -> None:
    """A PEFT LoRA folder with random A and B (B is zero in a fresh PEFT adapter: it would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    dims = shapes(config)
    for layer in range(config.num_hidden_layers):
        for t in targets:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{t}"
            fan_in, fan_out = dims[t]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank}
    cfg |= {"lora_alpha": alpha, "target_modules": targets, "bias": "none", "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/lora_adapters")
    base = resolve_model(None)
    config = AutoConfig.from_pretrained(base)
    for name, (rank, alpha, targets, seed) in ADAPTERS.items():
        write_adapter(out / name, base, config, rank, alpha, targets, seed)
        print(f"{out / name}: rank {rank}, alpha {alpha}, {', '.join(targets)}")


if __name__ == "__main__":
    main()
