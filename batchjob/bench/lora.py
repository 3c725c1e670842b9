"""``batchjob bench --adapters N[,N...] --lora-ranks R[,R...]``: LoRA adapters per row, side by side in one
process.

For each (adapter count N, rank R), N random adapters of rank R (PEFT's folder format, written to a temporary
folder; B random, not PEFT's zero init, so each adapter changes the answers) on every attention and MLP
projection of the bench's model, and the bench's rows dealt round-robin over them. Timed on the same rows:

- ``ours``: one engine holding the N adapters, every row under its adapter, in one run;
- ``peft mixed``: PEFT's mixed-batch ``generate(adapter_names=...)`` in static batches of
  ``--static-batch-size`` (left-padded, in workload order);
- ``merged``: one adapter after another, PEFT's ``merge_and_unload`` into a copy of the base model, then
  static ``generate`` on that adapter's rows (its time includes the merges, not the copies);

and once, the base model alone: ours with no adapter, and static ``generate``. Greedy, EOS ignored, each
request's own output length: every engine does the same work, and the report compares their tokens.
"""

from __future__ import annotations

import copy
import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from batchjob.bench.engines import Result, agreement, load_average, run_ours, run_static
from batchjob.bench.engines import header as bench_header
from batchjob.bench.options import BenchOptions
from batchjob.bench.workload import Workload
from batchjob.engine.options import by_engine_name
from batchjob.errors import ConfigError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- random adapters in PEFT's format ---------------------------------------------------------------------


def target_shapes(model: torch.nn.Module, targets: tuple[str, ...] | list[str]) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of the model's linear layers named one of ``targets``
    (a model on the meta device will do)."""
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }


def meta_model(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device: its module names and shapes, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write_adapter(
    folder: Path, base: str, shapes: dict[str, tuple[int, int]], rank: int, alpha: int, seed: int
) -> None:
    """A PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``, as ``save_pretrained``
    writes them) for the modules of ``shapes``, with random A and B: B is zero in a fresh PEFT adapter,
    which would change nothing."""
    from safetensors.torch import save_file

    if not shapes:
        raise ConfigError(f"{base}: no linear layer to put a LoRA adapter on")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({name.rsplit(".", 1)[-1] for name in shapes})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank}
    cfg |= {"lora_alpha": alpha, "target_modules": targets, "bias": "none", "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -- the runs ---------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One (adapter count, rank): each engine's fastest run on the rows dealt over the adapters."""

    adapters: int
    rank: int
    ours: Result
    peft: Result
    merged: Result
    changed: int  # requests whose tokens differ from the base model's (the adapters do something)

    def as_dict(self) -> dict[str, Any]:
        return {
            "adapters": self.adapters,
            "rank": self.rank,
            "results": {k: getattr(self, k).as_dict() for k in ("ours", "peft", "merged")},
            "agreement": {
                "peft": agreement(self.ours, self.peft),
                "merged": agreement(self.ours, self.merged),
            },
            "changed_from_base": self.changed,
        }


def _fastest(fn: Callable[[], Result], repeat: int) -> Result:
    """``fn``'s fastest of ``repeat`` runs (a busy machine only ever adds time), every wall time kept."""
    tries = []
    for _ in range(repeat):
        with torch.inference_mode():
            tries.append(fn())
    best = min(tries, key=lambda r: r.wall_s)
    best.walls = [r.wall_s for r in tries]
    return best


def _hf_model(engine: Any) -> Any:
    """A separate, unmodified copy of the model: the engine's has our paged attention plugged in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.model_id, dtype=engine.dtype)
    return model.to(engine.device).eval()


def _pad_id(engine: Any) -> int:
    pad = engine.tokenizer.pad_token_id
    return pad if pad is not None else min(engine.eos_token_ids, default=0)


def _peft_mixed(
    hf: Any, paths: dict[str, str], work: Workload, names: list[str], batch: int, pad: int
) -> Result:
    """PEFT's mixed batch: every adapter loaded into one ``PeftModel``, ``adapter_names`` per row."""
    import peft

    first, *rest = paths.items()
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), first[1], adapter_name=first[0]).eval()
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    vocab = int(hf.config.vocab_size)
    result = run_static(model, work, batch, pad, vocab, adapters=names)
    result.name, result.settings = "peft mixed", {"batch_size": batch}
    return result


def _merged(hf: Any, paths: dict[str, str], work: Workload, names: list[str], batch: int, pad: int) -> Result:
    """One adapter after another: merged into a copy of the base model, static generate on its rows."""
    import peft

    vocab = int(hf.config.vocab_size)
    outputs: list[list[int]] = [[] for _ in work.prompts]
    wall = 0.0
    for name, path in paths.items():
        rows = [i for i, n in enumerate(names) if n == name]
        if not rows:
            continue
        model = copy.deepcopy(hf)
        start = time.perf_counter()
        merged = peft.PeftModel.from_pretrained(model, path).merge_and_unload().eval()
        wall += time.perf_counter() - start
        part = Workload([work.prompts[i] for i in rows], [work.max_new_tokens[i] for i in rows], work.source)
        result = run_static(merged, part, batch, pad, vocab)
        wall += result.wall_s
        for i, out in zip(rows, result.outputs, strict=True):
            outputs[i] = out
        del model, merged
    return Result("merged", {"batch_size": batch}, wall, work.prompt_tokens, work.output_tokens, outputs)


def _ours_with(
    opts: BenchOptions, model_id: str, paths: dict[str, str], work: Workload, names: list[str]
) -> Result:
    """Our engine holding ``paths``' adapters, every row under its own; the engine goes when this returns."""
    from batchjob import Engine

    engine = Engine.from_pretrained(model_id, lora=paths, **by_engine_name(opts.engine_options))
    return _checked(
        _fastest(lambda: run_ours(engine, work, int(engine.vocab_size), adapters=names), opts.repeat),
        f"{len(paths)} adapter(s)",
    )


def _checked(result: Result, what: str) -> Result:
    """``result``, unless some of our requests failed: a rate over fewer rows is no figure (the bench stops)."""
    if result.error is not None:
        raise ConfigError(f"ours failed with {what}: {result.error}; no figure is printed")
    return result


def _cell(
    opts: BenchOptions,
    base: Any,
    hf: Any,
    work: Workload,
    count: int,
    rank: int,
    folder: Path,
    base_out: Result,
) -> Cell:
    """Write ``count`` adapters of ``rank``, then time ours, PEFT's mixed batch and merged-sequential."""
    shapes = target_shapes(hf, TARGETS)
    paths = {}
    for i in range(count):
        path = folder / f"r{rank}-{i}"
        write_adapter(path, base.model_id, shapes, rank, 2 * rank, seed=1000 * rank + i)
        paths[f"a{i}"] = str(path)
    names = [f"a{i % count}" for i in range(len(work.prompts))]
    batch, pad = opts.static_batch_size, _pad_id(base)
    _progress(f"running ours, {count} adapter(s) of rank {rank} ...")
    ours = _ours_with(opts, base.model_id, paths, work, names)
    _progress(f"running PEFT's mixed batch, {count} adapter(s) of rank {rank} ...")
    peft_result = _fastest(lambda: _peft_mixed(hf, paths, work, names, batch, pad), opts.repeat)
    _progress(f"running merged adapters one after another, {count} of rank {rank} ...")
    merged = _fastest(lambda: _merged(hf, paths, work, names, batch, pad), opts.repeat)
    gc.collect()
    changed = sum(a != b for a, b in zip(ours.outputs, base_out.outputs, strict=True))
    return Cell(count, rank, ours, peft_result, merged, changed)


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


def lora_bench(opts: BenchOptions, engine: Any, work: Workload, threads: int) -> None:
    """The adapters workload: the base runs once, then every (count, rank) cell; print, write JSON."""
    assert opts.adapters
    load_before = load_average()
    hf = _hf_model(engine)
    targets = sorted({name.rsplit(".", 1)[-1] for name in target_shapes(hf, TARGETS)})  # before any run
    if not targets:
        raise ConfigError(
            f"{engine.model_id}: the bench puts its random adapters on Linear layers named "
            f"{', '.join(TARGETS)}, and this model has none"
        )
    _progress("running ours, the base model alone ...")
    vocab = int(engine.vocab_size)
    base_ours = _checked(_fastest(lambda: run_ours(engine, work, vocab), opts.repeat), "the base model alone")
    _progress("running static generate, the base model alone ...")
    pad = _pad_id(engine)
    base_static = _fastest(lambda: run_static(hf, work, opts.static_batch_size, pad, vocab), opts.repeat)
    cells = []
    with tempfile.TemporaryDirectory(prefix="batchjob-bench-lora-") as tmp:
        for rank in opts.lora_ranks:
            for count in opts.adapters:
                cells.append(_cell(opts, engine, hf, work, count, rank, Path(tmp), base_ours))
    header = bench_header("batchjob bench --adapters", engine, threads, load_before)
    click.echo(format_lora_report(header, work, base_ours, base_static, cells, targets))
    if opts.json_path is not None:
        body = {
            "model": engine.model_id,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "torch_threads": threads,
            "load_average_before_after": [load_before, load_average()],
            "workload": work.describe() | {"seed": opts.seed},
            "base": {"ours": base_ours.as_dict(), "static": base_static.as_dict()},
            "cells": [c.as_dict() for c in cells],
        }
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        click.echo(f"results written to {opts.json_path}")


# -- the report -------------------------------------------------------------------------------------------

_COLUMNS = (
    ("adapters", 8),
    ("rank", 5),
    ("ours tok/s", 11),
    ("x base", 7),
    ("peft tok/s", 11),
    ("ours/peft", 10),
    ("merged tok/s", 13),
    ("ours/merged", 12),
    ("agree peft", 11),
    ("agree merged", 13),
    ("changed", 8),
)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "?"


def _row(cell: Cell, base: Result) -> list[str]:
    ours, peft_r, merged = cell.ours, cell.peft, cell.merged
    n = len(ours.outputs)
    agree_peft, agree_merged = agreement(ours, peft_r)["equal"], agreement(ours, merged)["equal"]
    return [
        str(cell.adapters),
        str(cell.rank),
        f"{ours.output_tps:.1f}",
        _ratio(ours.output_tps, base.output_tps),
        f"{peft_r.output_tps:.1f}",
        _ratio(ours.output_tps, peft_r.output_tps),
        f"{merged.output_tps:.1f}",
        _ratio(ours.output_tps, merged.output_tps),
        f"{agree_peft}/{n}",
        f"{agree_merged}/{n}",
        f"{cell.changed}/{n}",
    ]


def format_lora_report(
    header: str, work: Workload, base_ours: Result, base_static: Result, cells: list[Cell], targets: list[str]
) -> str:
    batch = base_static.settings["batch_size"]
    lines = [
        header,
        f"workload: {len(work.prompts)} requests ({work.source}), {work.prompt_tokens} prompt tokens, "
        f"{work.output_tokens} output tokens; greedy, EOS ignored; rows dealt round-robin over the adapters",
        f"adapters: random A and B on {', '.join(targets)}, alpha = 2 x rank; peft: PEFT's mixed batch "
        f"(adapter_names) in static batches of {batch}; merged: PEFT merge_and_unload per adapter, then static "
        f"generate (batches of {batch}) on its rows, one adapter after another (merges timed)",
        f"base model alone: ours {base_ours.output_tps:.1f} tok/s, static generate "
        f"{base_static.output_tps:.1f} tok/s (ours {_ratio(base_ours.output_tps, base_static.output_tps)})",
        "",
        " ".join(f"{name:>{width}}" for name, width in _COLUMNS),
    ]
    for cell in cells:
        lines.append(" ".join(f"{v:>{w}}" for v, (_, w) in zip(_row(cell, base_ours), _COLUMNS, strict=True)))
    lines.append("")
    lines.append(
        "tok/s: output tokens per second; x base: ours with adapters against ours without; agree: requests "
        "whose greedy tokens equal ours token for token; changed: requests the adapters changed from the base"
    )
    return "\n".join(lines)
