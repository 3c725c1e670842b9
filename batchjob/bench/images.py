"""``batchjob bench --image-sizes``: image rows through our engine against HF ``generate`` in static batches,
in one process, on the same rows.

Each row is one picture drawn with Pillow (distinct content a row, the sizes taken in turn) under one short
prompt in the processor's chat template. Ours preprocesses each row with the model's processor and adds it
with ``images=`` (the processor's image outputs); static ``generate`` preprocesses each batch of
``--static-batch-size`` rows at once (left padding) and runs ``model.generate(**inputs)`` on an unmodified
copy of the model. Both walls count their preprocessing; the report shows it apart too. Greedy, EOS
ignored, every row its own ``max_new_tokens``. transformers' continuous batching takes token ids only, no
images, so it is not run (the report says so).
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click

from batchjob.bench.engines import Result, agreement, load_average
from batchjob.bench.engines import header as bench_header
from batchjob.bench.options import BenchOptions
from batchjob.errors import ConfigError
from batchjob.job.ahead import default_workers

DEFAULT_OUTPUT_LEN = 16  # tokens an answer, when --output-len is not given: a short caption
PROMPT = "Describe the image."
NO_HF_CB = "transformers' continuous batching: not run (its requests are token ids; it takes no images)"

Rounds = Callable[[list[tuple[str, Callable[[], Result]]], int, bool], list[Result]]


# -- the workload ----------------------------------------------------------------------------------------


def make_picture(index: int, size: int, seed: int = 0) -> Any:
    """A ``size`` x ``size`` RGB picture, its content drawn from (seed, index): a background, a few shapes
    and lines of random colours, the index written in a corner."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed * 1_000_003 + index)

    def colour() -> tuple[int, int, int]:
        return rng.randrange(256), rng.randrange(256), rng.randrange(256)

    image = Image.new("RGB", (size, size), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        x1, y1 = (
            min(size, x0 + rng.randrange(8, size // 2 + 9)),
            min(size, y0 + rng.randrange(8, size // 2 + 9)),
        )
        shape = rng.choice(("rectangle", "ellipse", "line"))
        if shape == "line":
            draw.line((x0, y0, x1, y1), fill=colour(), width=max(1, size // 64))
        else:
            getattr(draw, shape)((x0, y0, x1, y1), fill=colour(), outline=colour())
    draw.text((2, 2), str(index), fill=colour())
    return image


@dataclass
class ImageWork:
    """The rows every engine runs: one picture each under one rendered prompt."""

    images: list[Any]  # PIL images, one a row
    sizes: list[int]  # pixels a side, per row
    text: str  # the prompt as the processor's chat template renders it (one image placeholder)
    max_new_tokens: list[int]
    prompt_tokens: list[int]  # per row, the image's tokens included (the processor's count)
    image_tokens: list[int]  # per row

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def warmup(self) -> ImageWork:
        """Two rows at the smallest size (other pictures), for a warm-up."""
        size = min(self.sizes)
        images = [make_picture(10**6 + i, size) for i in range(2)]
        return ImageWork(images, [size] * 2, self.text, [4, 4], self.prompt_tokens[:2], self.image_tokens[:2])

    def describe(self) -> dict[str, Any]:
        per_size = {
            s: sorted({t for t, z in zip(self.image_tokens, self.sizes, strict=True) if z == s})
            for s in dict.fromkeys(self.sizes)
        }
        return {
            "rows": len(self.images),
            "rows_per_size": {str(s): self.sizes.count(s) for s in per_size},
            "image_tokens_per_size": {str(s): t for s, t in per_size.items()},
            "prompt": PROMPT,
            "prompt_tokens": sum(self.prompt_tokens),
            "output_tokens": self.output_tokens,
        }


def render(processor: Any) -> str:
    """The prompt under one image in the processor's chat template (its image placeholder alone before the
    text when it has no template)."""
    if getattr(processor, "chat_template", None):
        content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
        return str(
            processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        )
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ConfigError(
            "the model's processor has no chat template and no image_token: cannot place the image"
        )
    return f"{token}\n{PROMPT}"


def image_workload(
    processor: Any,
    image_token_id: int,
    num_rows: int,
    sizes: Sequence[int],
    output_len: tuple[int, int],
    seed: int,
) -> ImageWork:
    """``num_rows`` pictures, the sizes in turn, each put through the processor once (untimed) to count its
    tokens; output lengths uniform in ``output_len`` from ``seed``."""
    text = render(processor)
    row_sizes = [sizes[i % len(sizes)] for i in range(num_rows)]
    images = [make_picture(i, s, seed) for i, s in enumerate(row_sizes)]
    prompt_tokens, image_tokens = [], []
    for image in images:
        ids = processor(images=[image], text=text, return_tensors="pt").input_ids[0]
        prompt_tokens.append(len(ids))
        image_tokens.append(int((ids == image_token_id).sum()))
    rng = random.Random(seed)
    outputs = [rng.randint(*output_len) for _ in range(num_rows)]
    return ImageWork(images, row_sizes, text, outputs, prompt_tokens, image_tokens)


# -- the runs --------------------------------------------------------------------------------------------


def _ours_pass(
    engine: Any, processor: Any, work: ImageWork, workers: int
) -> tuple[list[list[int]], float, float, str | None]:
    """Every row built and added, stepped to the end, as a job runs it (``job/ahead.py``, ``job/loop.py``):
    rows built by the processor on ``workers`` threads (0: on this one, each as it is admitted), each with
    its own copy, ahead of the engine (all of them from the start: a job keeps two a worker ahead, the
    bench's few rows need no bound); admitted in order while the engine holds fewer than the job's window
    of unfinished requests (twice ``max_num_seqs``), waiting for a row's build if it is not done. The
    admissions depend on the engine alone, not on the threads. Returns the outputs, the build seconds (summed
    over the threads) and the seconds the loop waited for builds."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from batchjob.sampling import SamplingParams

    def build(image: Any, proc: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        return proc(images=[image], text=work.text, return_tensors="pt"), time.perf_counter() - t0

    pool: ThreadPoolExecutor | None = None
    builds: list[Future[tuple[Any, float]]] = []
    if workers > 0:
        copies, local = [copy.deepcopy(processor) for _ in range(workers)], threading.local()

        def start() -> None:
            local.proc = copies.pop()

        def build_here(image: Any) -> tuple[Any, float]:  # on a worker, with its own copy
            return build(image, local.proc)

        pool = ThreadPoolExecutor(workers, "bench-images", initializer=start)
        builds = [pool.submit(build_here, im) for im in work.images]
    window = max(8, 2 * engine.config.max_num_seqs)
    pre = waited = 0.0
    done: dict[str, Any] = {}
    try:
        for i, n in enumerate(work.max_new_tokens):
            while engine.num_unfinished >= window:
                for out in engine.step():
                    done[out.request_id] = out
            t0 = time.perf_counter()
            inputs, seconds = builds[i].result() if pool is not None else build(work.images[i], processor)
            waited += time.perf_counter() - t0
            pre += seconds
            images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            engine.add_request(f"image-{i}", inputs.input_ids[0].tolist(), params, images=images)
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    outs = [done[f"image-{i}"] for i in range(len(work.images))]
    failed = [o for o in outs if o.finish_reason == "error"]
    error = f"{len(failed)} row(s) failed, e.g. {failed[0].error}" if failed else None
    return [list(o.token_ids) for o in outs], pre, waited, error


def run_ours_images(engine: Any, processor: Any, work: ImageWork, workers: int) -> Result:
    _ours_pass(engine, processor, work.warmup(), workers)
    engine.reset_prefix_cache()  # a repeated run computes its prompts again
    before = engine.stats.as_dict()
    start = time.perf_counter()
    outputs, pre, waited, error = _ours_pass(engine, processor, work, workers)
    wall = time.perf_counter() - start
    after = engine.stats.as_dict()
    extra = {k: after[k] - before[k] for k in ("forward_seconds", "step_seconds", "steps", "batched_tokens")}
    extra |= {"preprocess_seconds": pre, "build_wait_seconds": waited}
    extra |= {"encoded_images": engine.vision.encoded_images}
    settings = {
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "image_workers": workers,
    }
    return Result("ours", settings, wall, sum(work.prompt_tokens), work.output_tokens, outputs, extra, error)


def _static_pass(
    model: Any, processor: Any, work: ImageWork, batch_size: int, pad_id: int
) -> tuple[list[list[int]], float]:
    """HF ``generate`` over batches of rows preprocessed together, left-padded; each batch runs to its
    longest answer."""
    import torch
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    pre = 0.0
    for lo in range(0, len(work.images), batch_size):
        images, wants = work.images[lo : lo + batch_size], work.max_new_tokens[lo : lo + batch_size]
        t0 = time.perf_counter()
        inputs = processor(
            images=[[im] for im in images], text=[work.text] * len(images), padding=True, return_tensors="pt"
        )
        pre += time.perf_counter() - t0
        inputs = {
            k: v.to(model.device, model.dtype if v.is_floating_point() else v.dtype)
            for k, v in inputs.items()
        }
        # eos_token_id=[] (not None, which would fall back to the model's EOS): never stop early.
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(wants), eos_token_id=[], pad_token_id=pad_id
        )
        with torch.inference_mode():
            out = model.generate(**inputs, generation_config=config)
        new = out[:, inputs["input_ids"].shape[1] :].tolist()
        outputs.extend(row[:n] for row, n in zip(new, wants, strict=True))
    return outputs, pre


def run_static_images(model: Any, processor: Any, work: ImageWork, batch_size: int, pad_id: int) -> Result:
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        _static_pass(model, processor, work.warmup(), batch_size, pad_id)
        start = time.perf_counter()
        outputs, pre = _static_pass(model, processor, work, batch_size, pad_id)
        wall = time.perf_counter() - start
    finally:
        tokenizer.padding_side = side
    extra = {"preprocess_seconds": pre}
    settings = {"batch_size": batch_size}
    return Result("static", settings, wall, sum(work.prompt_tokens), work.output_tokens, outputs, extra)


# -- the report ------------------------------------------------------------------------------------------


def images_per_s(r: Result) -> float:
    return len(r.outputs) / r.wall_s if r.wall_s > 0 else 0.0


def format_image_report(work: ImageWork, results: list[Result], header: str) -> str:
    d = work.describe()
    width = max([len("engine"), *(len(r.label) for r in results)])
    sizes = ", ".join(
        f"{n} at {s} px ({'/'.join(map(str, d['image_tokens_per_size'][s]))} image tokens)"
        for s, n in d["rows_per_size"].items()
    )
    lines = [
        header,
        f"workload: {d['rows']} image rows, one image each: {sizes}; prompt {PROMPT!r}; {d['prompt_tokens']:,} "
        f"prompt tokens (image tokens included), {d['output_tokens']:,} output tokens; greedy, EOS ignored",
        "",
        f"{'engine':<{width}} {'wall s':>8} {'images/s':>9} {'out tok/s':>10} {'preprocess s':>13}",
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.label:<{width}} failed: {r.error}")
            continue
        runs = f"  (fastest of {', '.join(f'{w:.2f}' for w in r.walls)} s)" if len(r.walls) > 1 else ""
        lines.append(
            f"{r.label:<{width}} {r.wall_s:>8.2f} {images_per_s(r):>9.2f} {r.output_tps:>10.1f} "
            f"{r.extra['preprocess_seconds']:>13.2f}{runs}"
        )
    lines += [
        NO_HF_CB,
        "wall times include preprocessing (ours: the processor row by row on --image-workers threads ahead of "
        "the engine, as a job; static: batch by batch before each generate)",
        "",
    ]
    ours, static = _ok(results, "ours"), _ok(results, "static")
    if ours is not None and static is not None:
        lines.append(
            f"ratio ours/static (images/s, the same as output tok/s: equal work): {static.wall_s / ours.wall_s if ours.wall_s else float('nan'):.2f}x"
        )
        agree = agreement(ours, static)
        lines.append(
            f"agreement: ours == static greedy tokens on {agree['equal']}/{agree['total']} rows "
            "(token-exact; fp rounding may flip a few below float64)"
        )
    if ours is not None:
        x = ours.extra
        lines.append(
            f"our time: {ours.wall_s:.2f} s wall = waiting for row builds {x['build_wait_seconds']:.2f} s + "
            f"forward {x['forward_seconds']:.2f} s (vision tower included) + other "
            f"{ours.wall_s - x['build_wait_seconds'] - x['forward_seconds']:.2f} s; {x['steps']} steps; "
            f"the builds took {x['preprocess_seconds']:.2f} s on {ours.settings['image_workers']} thread(s)"
        )
    return "\n".join(lines)


def _ok(results: list[Result], name: str) -> Result | None:
    return next((r for r in results if r.name == name and r.error is None), None)


def summarize_images(results: list[Result]) -> dict[str, Any]:
    ours, static = _ok(results, "ours"), _ok(results, "static")
    if ours is None or static is None:
        return {"ratios": {}, "agreement": {}}
    return {
        "ratios": {"ours/static": static.wall_s / ours.wall_s},
        "agreement": {"static": agreement(ours, static)},
    }


# -- the command -----------------------------------------------------------------------------------------


def check_vlm(model: str | None) -> None:
    """Refuse, before any work, a model that is not a vision-language model batchjob runs."""
    from batchjob.engine.vision.family import SUPPORTED, check_family, is_vlm
    from batchjob.models import load_config

    if model is None:
        raise ConfigError(
            "--image-sizes needs a vision-language model folder as --model (the default model is a text model); "
            f"families: {', '.join(SUPPORTED)}"
        )
    config, _ = load_config(model)
    if not is_vlm(config):
        raise ConfigError(
            f"--image-sizes: --model {model} is a text model ({config.model_type!r}, no vision tower); "
            f"it needs a vision-language model, one of {', '.join(SUPPORTED)}"
        )
    check_family(config)


def output_len(opts: BenchOptions) -> tuple[int, int]:
    """--output-len as given, else short answers (DEFAULT_OUTPUT_LEN)."""
    source = click.get_current_context().get_parameter_source("output_len")
    given = source is not None and source != click.core.ParameterSource.DEFAULT
    return opts.output_len if given else (DEFAULT_OUTPUT_LEN, DEFAULT_OUTPUT_LEN)


def image_bench(opts: BenchOptions, rounds: Rounds, engine_options: dict[str, Any]) -> None:
    """Load ours, its processor and an unmodified HF copy; build the rows; run in rounds; report."""
    import torch
    import transformers

    assert opts.image_sizes
    check_vlm(opts.model)
    default_threads = torch.get_num_threads()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    used = torch.get_num_threads()
    load_before = load_average()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        engine, processor, work, runs = _prepare(opts, engine_options)
        results = rounds(runs, opts.repeat, opts.worker_thread)
    finally:
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(default_threads)
    title = f"batchjob bench --image-sizes {','.join(map(str, opts.image_sizes))}"
    header = bench_header(title, engine, used, load_before)
    click.echo(format_image_report(work, results, header))
    if opts.json_path is not None:
        body = {
            "workload": work.describe() | {"seed": opts.seed},
            "model": engine.model_id,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "torch_threads": used,
            "load_average_before_after": [load_before, load_average()],
            "results": [r.as_dict() | {"images_per_s": images_per_s(r)} for r in results],
            "not_run": {"hf-cb": NO_HF_CB},
            **summarize_images(results),
        }
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        click.echo(f"results written to {opts.json_path}")


def _prepare(
    opts: BenchOptions, engine_options: dict[str, Any]
) -> tuple[Any, Any, ImageWork, list[tuple[str, Callable[[], Result]]]]:
    """Our engine, the processor, the rows, and the round's runs (ours, then static generate)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from batchjob import Engine

    click.echo("loading our engine ...", err=True)
    engine = Engine.from_pretrained(opts.model, **engine_options)
    processor = AutoProcessor.from_pretrained(engine.model_id)
    assert opts.image_sizes and engine.vision is not None  # check_vlm let only a vision-language model in
    click.echo(f"drawing {opts.num_requests} pictures ...", err=True)
    work = image_workload(
        processor,
        engine.vision.image_token_id,
        opts.num_requests,
        opts.image_sizes,
        output_len(opts),
        opts.seed,
    )
    runs: list[tuple[str, Callable[[], Result]]] = []
    if "ours" in opts.baselines:
        workers = default_workers() if opts.image_workers is None else opts.image_workers
        runs.append(("ours", lambda: run_ours_images(engine, processor, work, workers)))
    if "static" in opts.baselines:
        # A separate, unmodified copy: the engine's model has our paged attention plugged in.
        hf = (
            AutoModelForImageTextToText.from_pretrained(engine.model_id, dtype=engine.dtype)
            .to(engine.device)
            .eval()
        )
        pad_id = processor.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
        runs.append(
            ("static", lambda: run_static_images(hf, processor, work, opts.static_batch_size, pad_id))
        )
    return engine, processor, work, runs
