"""The options of ``batchjob bench``: their types and checks, the click flags, and the values as one
dataclass the command's steps share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import click

BASELINES = ("ours", "hf-cb", "static", "llama.cpp")
DEFAULT_BASELINES = ("ours", "hf-cb", "static")  # llama.cpp is built separately (examples/peers/)


class LengthRange(click.ParamType):
    """``MIN,MAX`` (or ``N`` for a fixed length), integers with 1 <= MIN <= MAX."""

    name = "MIN,MAX"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            self.fail(f"expected MIN,MAX integers, got {value!r}", param, ctx)
        if len(nums) == 1:
            nums = nums * 2
        if len(nums) != 2 or not 1 <= nums[0] <= nums[1]:
            self.fail(f"expected MIN,MAX with 1 <= MIN <= MAX, got {value!r}", param, ctx)
        return nums[0], nums[1]


class TokenBudgets(click.ParamType):
    """A comma list of token budgets for transformers' continuous batching; ``auto`` is its own default."""

    name = "N[,N...]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[int | None]:
        if isinstance(value, list):
            return value
        out: list[int | None] = []
        for part in str(value).split(","):
            part = part.strip()
            if part == "auto":
                out.append(None)
                continue
            try:
                n = int(part)
            except ValueError:
                self.fail(f"expected integers or 'auto', got {part!r}", param, ctx)
            if n < 1:
                self.fail(f"token budgets must be >= 1, got {n}", param, ctx)
            out.append(n)
        return list(dict.fromkeys(out))


class Baselines(click.ParamType):
    name = "LIST"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        names = [p.strip() for p in str(value).split(",") if p.strip()]
        bad = [n for n in names if n not in BASELINES]
        if bad or not names:
            self.fail(f"choose from {','.join(BASELINES)}; got {value!r}", param, ctx)
        return [n for n in BASELINES if n in names]


class Counts(click.ParamType):
    """A comma list of positive integers, each once, in the order given."""

    name = "N[,N...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            nums = [int(p) for p in str(value).split(",")]
        except ValueError:
            self.fail(f"expected integers separated by commas, got {value!r}", param, ctx)
        if not nums or min(nums) < 1:
            self.fail(f"expected integers >= 1, got {value!r}", param, ctx)
        return list(dict.fromkeys(nums))


def _num_blocks(ctx: click.Context, param: click.Parameter, value: str) -> int | str | None:
    if value in ("workload", "auto"):
        return None if value == "auto" else value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected 'workload', 'auto' or an integer, got {value!r}") from None
    if n < 1:
        raise click.BadParameter(f"must be >= 1, got {n}")
    return n


def _sizes(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = [int(p) for p in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected S[,S...] integers, got {value!r}") from None
    if any(s < 8 for s in sizes):
        raise click.BadParameter(f"sizes must be >= 8 pixels, got {value!r}")
    return sizes


def _positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


# The bench's own flags, in the order `--help` shows them (our engine's options follow, from engine/options.py).
BENCH_FLAGS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option(
        "--model", default=None, help="Local model folder or hub id (default: embedded SmolLM2-135M)."
    ),
    click.option("--num-requests", type=int, default=64, show_default=True, callback=_positive),
    click.option(
        "--prompt-len",
        type=LengthRange(),
        default="24,600",
        show_default=True,
        help="Synthetic prompt lengths in tokens, log-uniform (mostly short).",
    ),
    click.option(
        "--output-len",
        type=LengthRange(),
        default="8,100",
        show_default=True,
        help="Tokens to generate, uniform.",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload."),
    click.option(
        "--dataset",
        type=click.Path(dir_okay=False, path_type=Path),
        help="JSONL or Parquet file with a 'prompt' or 'text' column: its first --num-requests usable rows "
        "are the prompts (rows without a text are skipped, prompts over the context less --output-len are "
        "cut; a line says how many, and when the file has fewer usable rows than asked for).",
    ),
    click.option(
        "--static-batch-size",
        type=int,
        default=8,
        show_default=True,
        callback=_positive,
        help="Batch size of static generate.",
    ),
    click.option(
        "--hf-cb-max-batch-tokens",
        type=TokenBudgets(),
        default="256",
        show_default=True,
        help="Token budget(s) for transformers' continuous batching, e.g. 128,256,512 or auto; the best is compared.",
    ),
    click.option(
        "--hf-cb-num-blocks",
        default="workload",
        show_default=True,
        callback=_num_blocks,
        help="Cache blocks (256 tokens each) for transformers' continuous batching: 'workload' (room for every "
        "request at once), 'auto' (its own sizing: most of free memory) or a number.",
    ),
    click.option(
        "--baselines",
        type=Baselines(),
        default=",".join(DEFAULT_BASELINES),
        show_default=True,
        help="Which engines to run, of "
        + ",".join(BASELINES)
        + ". llama.cpp (its llama-server on the workload, "
        "and llama-batched-bench too when every request has the same lengths) needs `bash "
        "examples/peers/llama_cpp.sh` once; it runs the model converted to GGUF at --dtype, KV cache the same.",
    ),
    click.option(
        "--image-sizes",
        callback=_sizes,
        metavar="S[,S...]",
        help="Image rows instead of text (bench/images.py), for a vision-language --model: --num-requests rows, "
        "one Pillow-drawn picture each, S x S pixels (the sizes in turn, e.g. 224,448), prompt 'Describe the "
        "image.', --output-len tokens (default 16 here). Ours against static generate only (transformers' "
        "continuous batching takes no images); walls count preprocessing.",
    ),
    click.option(
        "--image-workers",
        type=click.IntRange(min=0),
        metavar="N",
        help="--image-sizes: threads building our rows ahead of the engine, as `batchjob run --image-workers` "
        "(0: each row as it is admitted; default: the job's, one a CPU, at most 4).",
    ),
    click.option(
        "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write results here."
    ),
    click.option(
        "--threads",
        type=int,
        callback=_positive,
        help="torch intra-op threads for every engine (default: torch's).",
    ),
    click.option(
        "--repeat",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Run every engine this many times, in rounds (ours, static, hf-cb, ours, ...); each engine's "
        "figure is its fastest run, since a busy machine only ever adds time. Every run's wall time is reported.",
    ),
    click.option(
        "--worker-thread/--main-thread",
        default=False,
        show_default=True,
        help="Run ours and static generate in a worker thread, as transformers CB runs its loop (on a busy "
        "machine the main thread can be several times slower).",
    ),
    click.option(
        "--roofline/--no-roofline",
        default=True,
        show_default=True,
        help="Measure this machine's GEMM peak and weight bandwidth at the model's shapes (about a second) and "
        "report our prefill's and decode's shares of them. Splitting our time takes a prefill-only pass of ours "
        "after the runs, about as long as our run's prompts took.",
    ),
    click.option(
        "--task",
        type=click.Choice(["generate", "embed", "classify", "score"]),
        default="generate",
        show_default=True,
        help="embed, classify, score: ours against sentence-transformers encode and HF forward in padded batches, "
        "on docstrings of installed packages (bench/tasks.py); --num-requests texts.",
    ),
    click.option(
        "--text-tokens", type=LengthRange(), default="20,512", show_default=True, help="--task: text lengths."
    ),
    click.option(
        "--st-batch-sizes",
        type=TokenBudgets(),
        default="16,32,64,128",
        show_default=True,
        help="--task embed: sentence-transformers batch sizes tried (32, its default, always).",
    ),
    click.option(
        "--hf-batch-size", type=int, default=32, show_default=True, help="--task: HF forward batch size."
    ),
    click.option(
        "--adapters",
        type=Counts(),
        default=None,
        help="LoRA adapters per row: for each count N (e.g. 1,4,16) and each --lora-ranks, N random adapters "
        "on every attention and MLP projection, the rows dealt round-robin over them; ours against PEFT's "
        "mixed batch and merged adapters one after another, in static batches of --static-batch-size "
        "(bench/lora.py). --baselines does not apply.",
    ),
    click.option(
        "--lora-ranks",
        type=Counts(),
        default="16",
        show_default=True,
        help="--adapters: the adapters' ranks, e.g. 8,16,64.",
    ),
]


@dataclass
class BenchOptions:
    """The values of ``batchjob bench``'s flags, as click parsed and checked them."""

    model: str | None
    num_requests: int
    prompt_len: tuple[int, int]  # tokens, MIN and MAX
    output_len: tuple[int, int]  # tokens, MIN and MAX
    seed: int
    dataset: Path | None
    static_batch_size: int
    hf_cb_max_batch_tokens: list[int | None]  # None: transformers' own default
    hf_cb_num_blocks: int | str | None  # "workload", None (its own sizing) or a number
    baselines: list[str]  # in BASELINES' order
    json_path: Path | None
    image_sizes: list[int] | None  # pixels a side; None: the text workload
    image_workers: int | None  # --image-sizes: our row-building threads; None: the job's default
    threads: int | None
    repeat: int
    worker_thread: bool
    roofline: bool
    task: str
    text_tokens: tuple[int, int]  # tokens, MIN and MAX
    st_batch_sizes: list[int | None]
    hf_batch_size: int
    adapters: list[int] | None  # --adapters: adapter counts; None: no adapters workload
    lora_ranks: list[int]
    engine_options: dict[str, Any] = field(default_factory=dict)  # by job name, as `batchjob run` takes them

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> BenchOptions:
        """Split click's values: the bench's own, and our engine's (every name the bench doesn't declare)."""
        own = {f.name for f in fields(cls)} - {"engine_options"}
        engine = {k: v for k, v in params.items() if k not in own}
        return cls(**{k: v for k, v in params.items() if k in own}, engine_options=engine)
