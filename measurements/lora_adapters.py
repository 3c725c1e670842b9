"""LoRA adapters per row: the same requests spread over 1, 4 and 16 adapters of rank 8/16/64, against the
base model alone in our engine, and PEFT's mixed-batch ``generate`` (``adapter_names``, one padded static
batch) against plain static ``generate`` of the base model.

    python measurements/lora_adapters.py [--requests 16] [--prompt-len 64] [--new-tokens 32]

Random adapters (the writer of batchjob/bench/lora.py) on every attention and MLP projection of the
embedded default model, float32 on the CPU. Prints one line per configuration: seconds and output tokens/s.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(folder: Path, count: int, rank: int, base: str, config) -> dict[str, str]:
    from batchjob.bench.lora import meta_model, target_shapes, write_adapter

    shapes = target_shapes(meta_model(config), TARGETS)
    out = {}
    for i in range(count):
        path = folder / f"r{rank}-{i}"
        if not path.exists():
            write_adapter(path, base, shapes, rank, 2 * rank, seed=1000 * rank + i)
        out[f"a{i}"] = str(path)
    return out


def ours(prompts, names, lora, new_tokens: int) -> float:
    from batchjob import Engine, SamplingParams

    engine = Engine.from_pretrained(None, device="cpu", lora=lora or None)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], params, adapters=names[:2])  # warm-up
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, params, adapters=names)
    return time.perf_counter() - t0


def peft_static(prompts, names, lora, new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from batchjob.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    kwargs = {}
    if lora:
        import peft

        first, *rest = lora.items()
        model = peft.PeftModel.from_pretrained(model, first[1], adapter_name=first[0])
        for name, path in rest:
            model.load_adapter(path, adapter_name=name)
        kwargs["adapter_names"] = [n or "__base__" for n in names]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], **gen, **{k: v[:2] for k, v in kwargs.items()})
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, **gen, **kwargs)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--grid", default="4x16,1x16,16x16,4x8,4x64", help="COUNTxRANK,... of our runs")
    parser.add_argument("--no-peft", action="store_true", help="leave out PEFT's mixed batch")
    args = parser.parse_args()
    from transformers import AutoConfig

    from batchjob.models import resolve_model

    base = resolve_model(None)
    config = AutoConfig.from_pretrained(base)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    n, folder = args.new_tokens, Path(tempfile.mkdtemp(prefix="lora-bench-"))
    out_tokens = args.requests * n

    def line(what: str, seconds: float, ref: float | None = None) -> None:
        ratio = f"  {seconds / ref:.2f}x base" if ref else ""
        print(f"{what:<40} {seconds:7.2f} s  {out_tokens / seconds:7.1f} tok/s{ratio}", flush=True)

    base_s = ours(prompts, [None] * len(prompts), {}, n)
    line("ours, base model alone", base_s)
    for cell in args.grid.split(","):
        count, rank = map(int, cell.split("x"))
        lora = adapters(folder, count, rank, base, config)
        names = [f"a{i % count}" for i in range(len(prompts))]
        line(f"ours, {count} adapters rank {rank}", ours(prompts, names, lora, n), base_s)
    if not args.no_peft:
        static = peft_static(prompts, [None] * len(prompts), {}, n)
        line("HF static generate, base", static, base_s)
        lora = adapters(folder, 4, 16, base, config)
        names = [f"a{i % 4}" for i in range(len(prompts))]
        line("PEFT mixed batch, 4 adapters rank 16", peft_static(prompts, names, lora, n), base_s)


if __name__ == "__main__":
    main()
