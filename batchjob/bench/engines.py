"""Timing one workload through each engine: ours, transformers' continuous batching, static ``generate``.

Each runner warms its engine up on two short requests, then times the workload from the first submission to
the last result. All are greedy with EOS ignored and honour each request's own ``max_new_tokens``, so every
engine does the same work; a runner returns the generated ids so the report can compare them.
"""

from __future__ import annotations

import inspect
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchjob.bench.workload import Workload

_WARMUP_PROMPT_LEN = 16
_WARMUP_OUTPUT_LEN = 4
HF_CB_PAGE_SIZE = 256  # transformers' default page size (tokens per cache block)


@dataclass
class Result:
    name: str  # "ours", "hf-cb", "static"
    settings: dict[str, Any]
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # the tokens asked for: the same work for every engine
    outputs: list[list[int]] = field(repr=False)  # generated ids per request, in workload order
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    walls: list[float] = field(default_factory=list)  # with --repeat, every run's wall time (wall_s: fastest)

    @property
    def label(self) -> str:
        return self.name + "".join(f" {k}={v}" for k, v in self.settings.items())

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d["output_tokens_per_s"] = self.output_tps
        d["total_tokens_per_s"] = self.total_tps
        return d


def _warmup_workload(vocab_size: int) -> Workload:
    rng = random.Random(12345)
    prompts = [[rng.randrange(vocab_size) for _ in range(_WARMUP_PROMPT_LEN + i)] for i in range(2)]
    return Workload(prompts, [_WARMUP_OUTPUT_LEN] * 2, "warmup")


def run_ours(engine: Any, work: Workload, vocab_size: int, adapters: list[str] | None = None) -> Result:
    """Our engine on ``work``; ``adapters``: each request's LoRA adapter (the warm-up runs under the first)."""
    from batchjob.sampling import SamplingParams

    def params(w: Workload) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in w.max_new_tokens]

    warm = _warmup_workload(vocab_size)
    engine.generate(warm.prompts, params(warm), adapters=None if adapters is None else adapters[:1] * 2)
    engine.reset_prefix_cache()  # a repeated run must compute its prompts again
    before = engine.stats.as_dict()
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params(work), adapters=adapters)
    wall = time.perf_counter() - start
    after = engine.stats.as_dict()
    counted = (
        "forward_seconds",
        "step_seconds",
        "steps",
        "batched_tokens",
        "draft_tokens",
        "accepted_draft_tokens",
        "short_spin_steps",
    )
    diff = {k: after[k] - before[k] for k in counted}
    diff["preemptions"] = after["preemptions"] - before["preemptions"]
    diff["overhead_seconds"] = wall - diff["forward_seconds"]
    diff["overhead_fraction"] = diff["overhead_seconds"] / wall if wall > 0 else 0.0
    block_bytes = engine.config.block_size * engine.kv_token_bytes
    bm = engine.block_manager
    # what the pool holds: the blocks ever written (on the CPU memory is taken as a block is first written,
    # so a job holds the most KV it had in use, not the budget; a CUDA pool is taken whole at load)
    diff["kv_mib"] = round(bm.grown * block_bytes / 2**20, 1)
    diff["kv_budget_mib"] = round(bm.num_blocks * block_bytes / 2**20, 1)
    settings = {
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "num_speculative_tokens": engine.config.num_speculative_tokens,
        "cuda_graphs": engine.config.cuda_graphs,
        "compile": engine.config.compile,
    }
    failed = [o for o in outs if o.finish_reason == "error"]
    error = f"{len(failed)} request(s) failed, e.g. {failed[0].error}" if failed else None
    outputs = [o.token_ids for o in outs]
    return Result("ours", settings, wall, work.prompt_tokens, work.output_tokens, outputs, diff, error)


def run_static(
    model: Any,
    work: Workload,
    batch_size: int,
    pad_id: int,
    vocab_size: int,
    adapters: list[str] | None = None,
) -> Result:
    """Plain ``generate`` on left-padded batches in workload order; each batch runs to its longest output.
    ``adapters``: each request's adapter, for a PEFT model's mixed batch (``adapter_names``)."""
    import torch
    from transformers import GenerationConfig

    device = model.device

    def run(w: Workload, names: list[str] | None) -> tuple[list[list[int]], int]:
        outputs: list[list[int]] = []
        generated = 0
        for lo in range(0, len(w.prompts), batch_size):
            prompts, wants = w.prompts[lo : lo + batch_size], w.max_new_tokens[lo : lo + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            # eos_token_id=[] (not None, which would fall back to the model's EOS): never stop early.
            config = GenerationConfig(
                do_sample=False, max_new_tokens=max(wants), eos_token_id=[], pad_token_id=pad_id
            )
            kw = {} if names is None else {"adapter_names": names[lo : lo + batch_size]}
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **kw)
            new = out[:, width:].tolist()
            generated += len(prompts) * max(wants)
            outputs.extend(row[:n] for row, n in zip(new, wants, strict=True))
        return outputs, generated

    warm = _warmup_workload(vocab_size)
    run(warm, None if adapters is None else adapters[:1] * 2)
    start = time.perf_counter()
    outputs, generated = run(work, adapters)
    wall = time.perf_counter() - start
    return Result(
        "static",
        {"batch_size": batch_size},
        wall,
        work.prompt_tokens,
        work.output_tokens,
        outputs,
        {"generated_tokens_including_padding_waste": generated},
    )


def workload_num_blocks(work: Workload, page_size: int = HF_CB_PAGE_SIZE) -> int:
    """Cache blocks (of ``page_size`` tokens) for every request of ``work`` at once, the warm-up's included."""
    pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(work.prompts, work.max_new_tokens, strict=True))
    return pages + 4


def _cb_config(max_batch_tokens: int | None, num_blocks: int | None) -> Any:
    """transformers' ``ContinuousBatchingConfig`` at our page size: its keyword was ``block_size`` in
    transformers 5.17, ``page_size`` in 5.25."""
    from transformers import ContinuousBatchingConfig

    takes = inspect.signature(ContinuousBatchingConfig).parameters
    page = "page_size" if "page_size" in takes else "block_size"
    sizes: dict[str, Any] = {
        "max_batch_tokens": max_batch_tokens,
        "num_blocks": num_blocks,
        page: HF_CB_PAGE_SIZE,
    }
    return ContinuousBatchingConfig(**sizes)


def run_hf_cb(
    model: Any, work: Workload, max_batch_tokens: int | None, vocab_size: int, num_blocks: int | None
) -> Result:
    """transformers' continuous batching: a manager with per-request ``max_new_tokens`` and EOS disabled.

    ``num_blocks=None`` lets transformers size its cache: on CPU that is ~90% of the machine's RAM, zeroed
    (seconds per manager, untimed); a workload-sized cache holds every request at once, so nothing is preempted.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_new_tokens), eos_token_id=-1)
    cb_config = _cb_config(max_batch_tokens, num_blocks)
    # The hints generate_batch() would give: they size the block table and the requests per batch.
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.max_new_tokens),
        num_requests=len(work.prompts),
    )
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    settings = {
        "max_batch_tokens": "auto" if max_batch_tokens is None else max_batch_tokens,
        "num_blocks": "auto" if num_blocks is None else num_blocks,
    }

    def run(w: Workload, tag: str) -> tuple[dict[str, list[int]], str | None]:
        ids = [f"{tag}-{i}" for i in range(len(w.prompts))]
        for rid, prompt, n in zip(ids, w.prompts, w.max_new_tokens, strict=True):
            # eos_token_id=-1 matches no token: EOS is ignored; max_new_tokens is this request's own.
            manager.add_request(prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    return done, "transformers' generation thread stopped"
                continue
            if res.is_finished():
                if res.error is not None:
                    return done, f"request {res.request_id}: {res.error}"
                done[res.request_id] = list(res.generated_tokens)
        return done, None

    from batchjob.engine.cpu.spin import release_team

    release_team()  # this thread only waits while CB's computes: its idle OpenMP team would slow CB's
    manager.start()
    try:
        run(_warmup_workload(vocab_size), "warmup")
        start = time.perf_counter()
        done, error = run(work, "bench")
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [done.get(f"bench-{i}", []) for i in range(len(work.prompts))]
    return Result("hf-cb", settings, wall, work.prompt_tokens, work.output_tokens, outputs, error=error)


def agreement(ours: Result, other: Result) -> dict[str, int]:
    equal = sum(a == b for a, b in zip(ours.outputs, other.outputs, strict=True))
    return {"equal": equal, "total": len(ours.outputs)}


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the machine skews timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def header(title: str, engine: Any, threads: int, load_before: float | None, extra: str = "") -> str:
    """A bench report's first line: what ran where, and the machine's load before and after."""
    dtype = str(engine.dtype).removeprefix("torch.")
    return (
        f"{title}: model {Path(engine.model_id).name}, device {engine.device}, dtype {dtype}{extra}, torch threads "
        f"{threads}, load average {load_before} before, {load_average()} after (a busy machine makes timings noisy)"
    )
