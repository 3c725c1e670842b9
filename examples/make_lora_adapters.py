"""Build three random LoRA adapters for the embedded default model, in PEFT's folder format, for
``jobs/lora.toml`` (nothing can be downloaded, so their weights are random: each changes the answers, none
is trained).

    python examples/make_lora_adapters.py [OUT_DIR]     # default: out/lora_adapters

Each folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, as PEFT's ``save_pretrained``
writes them; peft itself is not needed. The writer is
``batchjob bench --adapters``'s (batchjob/bench/lora.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoConfig

from batchjob.bench.lora import meta_model, target_shapes, write_adapter
from batchjob.models import resolve_model

# name -> (rank, alpha, target modules, seed)
ADAPTERS = {
    "formal": (8, 16, ["q_proj", "v_proj"], 1),
    "terse": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 2),
    "pirate": (8, 32, ["gate_proj", "up_proj", "down_proj"], 3),
}


def build(out: Path) -> dict[str, Path]:
    """Write the adapters under ``out``; their folders by name."""
    base = resolve_model(None)
    model = meta_model(AutoConfig.from_pretrained(base))  # module names and shapes, no weights
    for name, (rank, alpha, targets, seed) in ADAPTERS.items():
        write_adapter(out / name, base, target_shapes(model, targets), rank, alpha, seed)
        print(f"{out / name}: rank {rank}, alpha {alpha}, {', '.join(targets)}")
    return {name: out / name for name in ADAPTERS}


def main() -> None:
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "out/lora_adapters"))


if __name__ == "__main__":
    main()
