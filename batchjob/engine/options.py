"""The engine's options, each declared once: name, default, help text and check.

``EngineOptions`` holds them as given (``None``: the engine decides, per device, per attention backend,
from the model); ``EngineConfig`` (``config.py``) is the same fields resolved for a device.
``Engine.from_pretrained`` takes them as one object or as keywords; the job layer (``JobSpec.engine``, job
files) and the command line (``run``, ``validate``, ``bench``) build their fields and flags from these
declarations (``job_options``), so an option, its default and its check exist in one place.

This module imports nothing heavy (no torch): the command line reads it before it knows it needs a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from batchjob.errors import ConfigError

DTYPE_CHOICES = ("auto", "float32", "float64", "bfloat16", "float16")
DEVICE_NAME = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEFAULT_SPECULATIVE_TOKENS = 4  # most prompt-lookup drafts a request takes per step (it starts at one)

# The attention_backend option's values: auto, or a backend's ``option`` (engine/attention/registry.py lists
# the same; a test holds them equal, so this module need not import the backends).
ATTENTION_BACKENDS = ("auto", "flex", "torch", "cpu", "flash", "varlen")
TASKS = ("generate", "embed", "classify", "score")  # engine/tasks.py: what a request computes
POOLINGS = ("cls", "mean", "last")
DEVICE_WORDS = {"cuda": "CUDA", "cpu": "CPU"}

Check = Callable[[Any], "str | None"]  # what is wrong with a value ("must be ..., got 0"), None when fine


@dataclass(frozen=True)
class Option:
    """How one engine option appears outside the engine (``option()`` declares it)."""

    help: str  # the command line's help, which is also the option's documentation
    kind: type  # int, float, bool or str: its type in job files and on the command line
    check: Check | None = None  # applied to every value given (None, "the engine decides", is never checked)
    choices: tuple[str, ...] = ()  # str options with a fixed set of values
    job_name: str | None = None  # its name in job files and on the command line, where that differs
    job: bool = True  # whether jobs have it (False: the job layer sets it itself)
    metavar: str | None = None
    # "The engine decides", per device type: the value None (or "auto") resolves to on each (EngineConfig);
    # a device type not listed keeps None (decided otherwise: a KV pool sized by profiling the GPU).
    per_device: tuple[tuple[str, Any], ...] = ()

    def device_default(self, device_type: str) -> Any:
        """The value the engine decides on a device of this type (None: not by device)."""
        return dict(self.per_device).get(device_type)

    def complaint(self, name: str, value: Any) -> str | None:
        """What is wrong with ``value`` for the option called ``name``, in one line; None when fine."""
        if value is None or self.check is None:
            return None
        wrong = self.check(value)
        return None if wrong is None else f"{name} {wrong}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def option(default: Any, kind: type, help: str, **how: Any) -> Any:
    """A field of ``EngineOptions`` that is an engine option: ``how`` is the rest of ``Option``
    (``per_device`` may be given as a dict)."""
    per_device = how.get("per_device")
    if isinstance(per_device, dict):
        how["per_device"] = tuple(per_device.items())
        each = ", ".join(f"{_shown(v)} on {DEVICE_WORDS.get(d, d)}" for d, v in per_device.items())
        help = f"{help} (default: {each})."  # the help shows what the declaration says, never a copy
    return field(default=default, metadata={"option": Option(help, kind, **how)})


def device_default(name: str, device_type: str) -> Any:
    """What the engine decides for option ``name`` on a device of this type, from its declaration."""
    return next(opt for f, opt in declared() if f.name == name).device_default(device_type)


def integer(lo: int, hi: int | None = None, why: str = "") -> Check:
    def check(value: Any) -> str | None:
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= lo
            and (hi is None or value <= hi)
        ):
            return None
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        return f"must be an integer {bound}{why}, got {value!r}"

    return check


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> str | None:
    return None if _number(value) and value > 0 else f"must be a finite number > 0, got {value!r}"


def _share(value: Any) -> str | None:
    return None if _number(value) and 0.0 < value <= 1.0 else f"must be in (0, 1], got {value!r}"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _torch(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "torch"  # a torch.device or torch.dtype: checked on use


def _device(value: Any) -> str | None:
    ok = _torch(value) or isinstance(value, str) and DEVICE_NAME.match(value)
    return None if ok else f"must be auto, cpu, cuda or cuda:N; got {value!r}"


def _dtype(value: Any) -> str | None:
    ok = _torch(value) or value in DTYPE_CHOICES
    return None if ok else f"must be one of {', '.join(DTYPE_CHOICES)}; got {value!r}"


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}; got {value!r}"

    return check


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"must be a string; got {value!r}"


def _attention_backend(value: Any) -> str | None:
    ok = value in ATTENTION_BACKENDS
    return None if ok else f"must be one of {', '.join(ATTENTION_BACKENDS)}; got {value!r}"


@dataclass
class EngineOptions:
    """Every engine option, as given: each given value is checked on creation, and None becomes the declared
    default (which may itself be None: the engine decides, in ``EngineConfig``)."""

    device: Any = option(
        "auto", str, "auto, cpu, cuda or cuda:N (default: auto: cuda when there is one).", check=_device
    )
    dtype: Any = option(
        "auto",
        str,
        "Weights dtype",
        check=_dtype,
        choices=DTYPE_CHOICES,
        per_device={"cuda": "bfloat16", "cpu": "float32"},
    )
    attention_backend: str = option(
        "auto",
        str,
        "Attention backend: auto (chosen by device, dtype and what the model needs: on CUDA flash if "
        "flash-attn is installed, else flex; on the CPU the C++ decode kernel, else flex for soft-capping "
        "or sinks, else torch), or one of flex, torch, cpu, flash, varlen, which must be able to run the "
        "model (default: auto).",
        choices=ATTENTION_BACKENDS,
        check=_attention_backend,
    )
    max_num_batched_tokens: int | None = option(
        None,
        int,
        "Tokens per engine step; on the CPU a generating model whose MLP activation over 2048 tokens fits "
        "glibc's 32 MiB mmap threshold takes 2048",
        check=integer(1),
        per_device={"cuda": 8192, "cpu": 512},
    )
    max_num_seqs: int | None = option(
        None, int, "Requests running at once", check=integer(1), per_device={"cuda": 256, "cpu": 64}
    )
    block_size: int | None = option(
        None,
        int,
        "Tokens per KV block (default: the attention backend's: 256 for the flash and varlen backends' paged "
        "kernels, else 16).",
        check=integer(1),
    )
    kv_memory_gb: float | None = option(
        None,
        float,
        "KV cache budget in GiB; on CUDA by default what gpu_memory_utilization leaves after the weights and "
        "a warm-up forward",
        check=_positive,
        per_device={"cpu": 2.0},
    )
    num_blocks: int | None = option(
        None, int, "KV cache size in blocks (overrides --kv-memory-gb).", check=integer(1)
    )
    max_model_len: int | None = option(
        None,
        int,
        "Cap the context (prompt + output) the engine accepts, at most the model's own; longer prompts become "
        "error rows (default: the model's context). The KV pool must hold one request of this length.",
        check=integer(2, why=" (a prompt token and one more)"),
        metavar="TOKENS",
    )
    gpu_memory_utilization: float = option(
        0.9, float, "CUDA: share of GPU memory for weights, activations and KV (default: 0.9).", check=_share
    )
    enable_prefix_caching: bool = option(
        True,
        bool,
        "Share the KV of equal prompt prefixes between rows (default: on).",
        check=_flag,
        job_name="prefix_caching",
    )
    num_speculative_tokens: int | None = option(
        None,
        int,
        "Draft tokens per row and step copied from the row's own context, verified in the same forward: the "
        f"same answers in fewer steps when outputs repeat their context (default: {DEFAULT_SPECULATIVE_TOKENS}; "
        "0: off).",
        check=integer(0, 64),
    )
    # True on a CPU runs the same padded buckets eagerly (nothing to capture there; the tests use it).
    cuda_graphs: bool | None = option(
        None,
        bool,
        "CUDA: replay decode steps from CUDA graphs bucketed by batch size",
        check=_flag,
        per_device={"cuda": True, "cpu": False},
    )
    compile: bool = option(
        False,
        bool,
        "Run the model under torch.compile (compiles on first use; default: off).",
        check=_flag,
    )
    tensor_parallel_size: int = option(
        1,
        int,
        "Split the model across N ranks on this node (tensor parallelism: each holds 1/N of the weights and "
        "of the KV heads; CUDA devices from --device's on, or N CPU processes), for a model larger than one "
        "device. The family needs a tensor-parallel plan and head counts divisible by N (default: 1).",
        check=integer(1),
        metavar="N",
    )
    # The task (engine/tasks.py) and its options: jobs take them (``batchjob run --task``, JobSpec checks
    # which make sense for which task).
    task: str = option(
        "generate",
        str,
        "What each request computes: generate (text), embed (a pooled hidden state), classify (a "
        "sequence-classification head's logits) or score (the log-likelihood of the text) (default: "
        "generate).",
        choices=TASKS,
        check=_one_of(TASKS),
    )
    pooling: str | None = option(
        None,
        str,
        "embed: cls, mean or last (default: the model folder's sentence-transformers pooling, else mean).",
        choices=POOLINGS,
        check=_one_of(POOLINGS),
    )
    normalize: bool | None = option(
        None,
        bool,
        "embed: scale each embedding to unit length (default: when the model folder's sentence-transformers "
        "modules include Normalize).",
        check=_flag,
    )
    dimensions: int | None = option(
        None,
        int,
        "embed: keep the first N dimensions (Matryoshka), renormalised when normalize is on.",
        check=integer(1),
        metavar="N",
    )
    prompt_name: str | None = option(
        None,
        str,
        "embed: which of the model folder's sentence-transformers prompts goes before each text, as "
        "encode(prompt_name=NAME) puts it ('' for none; default: the folder's default_prompt_name, else none).",
        check=_text,
        metavar="NAME",
    )
    truncate: bool = option(
        False,
        bool,
        "embed, classify, score: cut a text longer than the model's limit to the limit (default: off: such a "
        "request is an error).",
        check=_flag,
    )
    # Jobs set these two themselves: static batching is their --admission static, and a job always wants a
    # pool that holds one request of the full context.
    static_batching: bool = option(
        False,
        bool,
        "The baseline: admit a batch, then nothing until all of it finished.",
        check=_flag,
        job=False,
    )
    check_kv_pool: bool | None = option(
        None,
        bool,
        "Refuse a KV pool that cannot hold one request of max_model_len tokens (default: only when the "
        "engine sized the pool itself; an explicit num_blocks may be small on purpose).",
        check=_flag,
        job=False,
    )

    def __post_init__(self) -> None:
        for f, opt in declared():
            value = getattr(self, f.name)
            if value is None:
                setattr(self, f.name, f.default)
            wrong = opt.complaint(f.name, value)
            if wrong is not None:
                raise ConfigError(wrong)

    def as_keywords(self) -> dict[str, Any]:
        """Every option by its engine name: the keywords of ``EngineConfig`` and ``Engine.from_pretrained``."""
        return {f.name: getattr(self, f.name) for f in fields(EngineOptions)}


def declared() -> list[tuple[Field[Any], Option]]:
    """Every engine option: ``EngineOptions``' fields with their declarations, in order."""
    return [(f, f.metadata["option"]) for f in fields(EngineOptions) if "option" in f.metadata]


def job_options() -> list[tuple[str, Field[Any], Option]]:
    """The engine options jobs and the command line have, as ``(job name, field, declaration)``."""
    return [(opt.job_name or f.name, f, opt) for f, opt in declared() if opt.job]


def by_engine_name(values: dict[str, Any]) -> dict[str, Any]:
    """Option values keyed by their job names (as the command line gives them) under the engine's names."""
    names = {name: f.name for name, f, _ in job_options()}
    return {names.get(k, k): v for k, v in values.items()}
