"""``batchjob bench --task embed|classify|score``: our packed prefill-only engine against the anchors people
run today, on the same texts in one process.

- ``embed``: sentence-transformers ``encode`` at its default batch size (32) and at each of
  ``--st-batch-sizes`` (the best is reported too); HF ``forward`` of the model's body in padded batches
  (length-sorted, as sentence-transformers sorts) with our pooling.
- ``classify``: HF ``forward`` of the sequence-classification model in padded, length-sorted batches.
- ``score``: HF ``forward`` of the causal LM in padded, length-sorted batches, log-softmax of every row.

The texts are real and of mixed lengths: docstrings of the installed Python packages, kept when they are
``--text-tokens MIN,MAX`` tokens long (default 20 to 512), drawn with a seed. Each engine runs ``--repeat``
times in rounds after a warm-up on a few texts; the figure is its fastest run's texts and tokens per second
of wall time.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchjob.bench.engines import header as bench_header
from batchjob.bench.engines import load_average
from batchjob.errors import ConfigError

# Packages whose docstrings make the texts: installed with batchjob, prose of every length.
_PACKAGES = (
    "json",
    "email",
    "http",
    "logging",
    "unittest",
    "argparse",
    "asyncio",
    "collections",
    "concurrent",
    "xml",
    "click",
    "pyarrow",
    "numpy",
)


def docstring_texts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` docstrings of installed packages whose token counts are in [lo, hi] (fewer if there are not
    that many), in a seeded random order."""
    seen: set[str] = set()
    docs: list[str] = []
    for name in _PACKAGES:
        try:
            pkg = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a package that fails to import gives no texts
            continue
        modules = [pkg]
        for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), name + "."):
            if len(modules) > 40 or "test" in info.name:
                break
            try:
                modules.append(importlib.import_module(info.name))
            except Exception:  # noqa: BLE001
                continue
        for mod in modules:
            for obj in [mod, *vars(mod).values()]:  # vars: no lazy attribute is imported
                doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
                if doc and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    docs.sort()
    random.Random(seed).shuffle(docs)
    out = []
    for doc in docs:
        k = len(tokenizer(doc, add_special_tokens=True).input_ids)
        if lo <= k <= hi:
            out.append(doc)
            if len(out) == n:
                break
    return out


@dataclass
class TaskResult:
    name: str
    seconds: float  # the fastest run's wall time
    texts: int
    tokens: int
    walls: list[float] = field(default_factory=list)  # every run's wall time, in order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "texts": self.texts,
            "tokens": self.tokens,
            "walls": self.walls,
        }


Runs = list[tuple[str, Callable[[], Any]]]


def _rounds(
    runs: Runs, repeat: int, texts: int, tokens: int, progress: Callable[[str], None]
) -> list[TaskResult]:
    """Every run ``repeat`` times, in rounds (ours, each anchor, ours, ...: a slow spell of the machine hits
    them alike); each figure is the fastest run. The first pass over the texts pays the process's first
    touch of its heap pages, which a long job pays once: with ``--repeat 2`` and more no side is timed
    only cold."""
    walls: list[list[float]] = [[] for _ in runs]
    for round_ in range(repeat):
        for (name, fn), done in zip(runs, walls, strict=True):
            progress(f"running {name}{f' (run {round_ + 1} of {repeat})' if repeat > 1 else ''} ...")
            t0 = time.perf_counter()
            with torch.inference_mode():
                fn()
            done.append(time.perf_counter() - t0)
    return [TaskResult(name, min(w), texts, tokens, w) for (name, _), w in zip(runs, walls, strict=True)]


def _padded_batches(tokenizer, texts: list[str], batch_size: int, limit: int, device):
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    for s in range(0, len(order), batch_size):
        batch = [texts[i] for i in order[s : s + batch_size]]
        enc = tokenizer(batch, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        yield {k: v.to(device) for k, v in enc.items()}


def run_task_bench(
    task: str,
    engine,
    texts: list[str],
    st_batch_sizes: list[int],
    hf_batch_size: int,
    progress: Callable[[str], None],
    repeat: int = 1,
) -> list[TaskResult]:
    """Time ours and the anchors of ``task`` on ``texts``; every baseline loads its own unmodified copy."""
    ids = [engine.tokenize(t) for t in texts]
    # a text past the model's limit with its prompt (a sentence-transformers prompt is added) is no one's work
    keep = [i for i, x in enumerate(ids) if len(x) <= engine.prefill_limit]
    texts, ids = [texts[i] for i in keep], [ids[i] for i in keep]
    tokens = sum(len(x) for x in ids)
    warm = texts[:4]
    run = {"embed": engine.embed, "classify": engine.classify, "score": engine.score}[task]
    run(warm)
    progress(f"ours: {len(texts)} texts, {tokens} tokens")

    def ours() -> None:  # a text ours refused would be credited as done
        failed = [o for o in run(texts) if o.finish_reason == "error"]  # tokenized in the timing, as anchors'
        if failed:
            raise ConfigError(f"ours failed {len(failed)} of {len(ids)} texts: {failed[0].error}")

    runs: Runs = [("ours", ours)]
    if task == "embed":
        runs += _embed_anchors(engine, texts, st_batch_sizes, hf_batch_size)
    else:
        runs.append(_hf_forward(task, engine, texts, hf_batch_size))
    return _rounds(runs, repeat, len(texts), tokens, progress)


def _embed_anchors(engine, texts: list[str], st_batch_sizes: list[int], hf_batch_size: int) -> Runs:
    """sentence-transformers ``encode`` at batch 32 and at each of ``st_batch_sizes``, then HF ``forward`` of
    its body in padded batches with our pooling."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    device, dtype = engine.device, engine.dtype
    st = SentenceTransformer(engine.model_id, device=str(device))
    st.to(dtype)
    prompt = engine.tasks.pooling.prompt or ""  # the prompt ours adds (a folder's default, or --prompt-name)
    st.encode(texts[:4], prompt=prompt)
    runs: Runs = [
        (f"st-encode batch={b}", lambda b=b: st.encode(texts, batch_size=b, prompt=prompt))
        for b in dict.fromkeys([32, *st_batch_sizes])
    ]
    body = st[0].auto_model if hasattr(st[0], "auto_model") else AutoModel.from_pretrained(engine.model_id)
    pooling = engine.tasks.pooling

    def hf_embed() -> None:
        prompted = [prompt + t for t in texts]
        for enc in _padded_batches(engine.tokenizer, prompted, hf_batch_size, engine.prefill_limit, device):
            h = body(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            if pooling.mode == "mean":
                (h * mask).sum(1) / mask.sum(1)
            elif pooling.mode == "cls":
                h[:, 0]
            else:
                h[torch.arange(h.shape[0]), enc["attention_mask"].sum(1) - 1]

    return [*runs, (f"hf-forward batch={hf_batch_size}", hf_embed)]


def _hf_forward(task: str, engine, texts: list[str], hf_batch_size: int) -> tuple[str, Callable[[], Any]]:
    """classify, score: HF ``forward`` of the model in padded, length-sorted batches (score: log-softmax)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    device = engine.device
    auto = AutoModelForSequenceClassification if task == "classify" else AutoModelForCausalLM
    hf = auto.from_pretrained(engine.model_id, dtype=engine.dtype).to(device).eval()

    def hf_forward() -> None:
        for enc in _padded_batches(engine.tokenizer, texts, hf_batch_size, engine.prefill_limit, device):
            out = hf(**enc)
            if task == "score":
                lp = torch.log_softmax(out.logits[:, :-1], dim=-1)
                lp.gather(2, enc["input_ids"][:, 1:, None])

    return f"hf-forward batch={hf_batch_size}", hf_forward


def format_task_report(task: str, header: str, results: list[TaskResult]) -> str:
    ours = results[0]
    lines = [header, f"task {task}: {ours.texts} texts, {ours.tokens} tokens", ""]
    lines.append(f"{'engine':<28}{'seconds':>10}{'texts/s':>10}{'tokens/s':>11}{'ours x':>9}")
    for r in results:
        ratio = r.seconds / ours.seconds if ours.seconds else float("nan")
        lines.append(
            f"{r.name:<28}{r.seconds:>10.2f}{r.texts / r.seconds:>10.1f}{r.tokens_per_s:>11.0f}{ratio:>9.2f}"
        )
    if any(len(r.walls) > 1 for r in results):
        lines.append("every run's seconds (each figure above is the fastest):")
        lines += [f"  {r.name:<26}" + ", ".join(f"{w:.2f}" for w in r.walls) for r in results]
    st = [r for r in results if r.name.startswith("st-encode")]
    if st:
        best = min(st, key=lambda r: r.seconds)
        default = next(r for r in st if r.name == "st-encode batch=32")
        lines.append("")
        lines.append(
            f"ours vs sentence-transformers encode: {default.seconds / ours.seconds:.2f}x its batch 32, "
            f"{best.seconds / ours.seconds:.2f}x its best ({best.name.split()[-1]})"
        )
    return "\n".join(lines)


def task_bench(
    task: str,
    model: str | None,
    num_requests: int,
    seed: int,
    text_tokens: tuple[int, int],
    st_batch_sizes: list[int],
    hf_batch_size: int,
    threads: int | None,
    json_path,
    engine_options: dict[str, Any],
    repeat: int = 1,
) -> None:
    """The ``--task`` runs of ``batchjob bench``: load ours, draw the texts, time, print (and write JSON)."""
    import json

    import click

    from batchjob import Engine

    def progress(msg: str) -> None:
        click.echo(msg, err=True)

    default_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    load_before = load_average()
    try:
        progress(f"loading our engine (task {task}) ...")
        engine = Engine.from_pretrained(model, task=task, **engine_options)
        hi = min(text_tokens[1], engine.prefill_limit)
        texts = docstring_texts(engine.tokenizer, num_requests, text_tokens[0], hi, seed)
        results = run_task_bench(task, engine, texts, st_batch_sizes, hf_batch_size, progress, repeat)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(default_threads)
    attention = f", attention {engine.runner.attention.name}"
    header = bench_header(f"batchjob bench --task {task}", engine, used, load_before, attention)
    click.echo(format_task_report(task, header, results))
    if json_path is not None:
        body = {
            "task": task,
            "model": engine.model_id,
            "texts": len(texts),
            "text_tokens": list(text_tokens),
            "torch_threads": used,
            "repeat": repeat,
            "load_average_before_after": [load_before, load_average()],
            "results": [r.as_dict() for r in results],
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        click.echo(f"results written to {json_path}")
