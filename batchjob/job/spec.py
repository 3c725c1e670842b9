"""A job's specification: every option of ``batchjob run`` in one validated dataclass, and TOML job files.

The engine's options are not declared here: ``EngineConfig`` (``engine/config.py``) declares each one once,
and ``JobSpec`` gets a field for each (same name, default and check; ``None``: the engine decides).

A job file holds the same fields as the command line (``max_new_tokens`` or ``max-new-tokens``, not both);
options given on the command line override it. Relative ``input`` and ``output`` paths in a job file are
relative to the job file's folder, so a job file works from any working directory. A relative ``model`` is
a folder next to the job file when one exists there (or it starts with ``./`` or ``../``), else a folder in
the working directory when one exists there, else a hub id.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.engine.options import job_options
from batchjob.errors import ConfigError
from batchjob.job.admission import ADMISSION_CHOICES
from batchjob.sampling import SamplingParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
FORMAT_CHOICES = ("rows", "openai")


def _with_engine_options(cls: type) -> type:
    """Give the (not yet dataclass) ``cls`` a field per engine option jobs have, as ``EngineConfig`` declares
    it: its job name (``prefix_caching`` for ``enable_prefix_caching``), type, default and declaration."""
    for name, f, opt in job_options():
        cls.__annotations__[name] = opt.kind.__name__ + (" | None" if f.default is None else "")
        setattr(cls, name, field(default=f.default, metadata={"option": opt}))
    return cls


@dataclass
@_with_engine_options
class JobSpec:
    """What to run. Defaults here are the command line's defaults (temperature 0: greedy, reproducible).

    Besides the fields below, one per engine option (``EngineConfig``'s, by their job names): ``device``,
    ``dtype``, ``max_num_batched_tokens``, ``max_num_seqs``, ``block_size``, ``kv_memory_gb``, ``num_blocks``,
    ``max_model_len``, ``gpu_memory_utilization``, ``prefix_caching``, ``num_speculative_tokens``,
    ``cuda_graphs``, ``compile``.
    """

    input: list[str] = field(default_factory=list)
    output: str | None = None
    # prompt construction: at most one of prompt_column, messages_column, template
    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None
    system: str | None = None
    chat: bool | None = None  # None: chat when the tokenizer has a chat template
    id_column: str | None = None
    # "rows": each input row is a record with columns; "openai": each line is an OpenAI Batch API request
    format: str = "rows"
    params_column: str | None = None  # a column of per-row sampling parameters (JSON object or struct)
    check_model_name: bool = False  # --format openai: a request whose body.model is not this model fails
    chat_template_kwargs: dict[str, Any] | str | None = (
        None  # keyword arguments for the chat template: a JSON object (or its text)
    )
    reasoning_tags: str | None = None  # "OPEN,CLOSE": the think tags (default: found in the tokenizer)
    # model
    model: str | None = None  # None: the embedded default model
    trust_remote_code: bool = False  # run Python code the model's folder ships (not part of the identity)
    # sampling
    max_new_tokens: int = 128
    temperature: float | None = None  # None: 0 (greedy), or OpenAI's 1 for --format openai
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # constraints and samples
    choices: list[str] | None = None  # the answer is exactly one of these ("a,b,c" is split at commas)
    json_schema: str | None = None  # path of a JSON schema file; the answer is JSON valid against it
    regex: str | None = None  # the answer matches this regular expression
    logprobs: int | None = None  # top-K log-probabilities of each generated token, in a column
    n: int = 1  # samples per row: n result rows, each with its sample_index
    max_reasoning_tokens: int | None = None  # reasoning models: close the thinking after this many tokens
    # admission (with --admission static, the engine's static_batching)
    admission: str = "fcfs"  # fcfs | longest-first | shortest-first | static
    lookahead: int = 512  # rows read ahead to choose from (longest-first, shortest-first)
    # state
    append: bool = False  # the inputs grew (rows appended, files added): process the new rows
    checkpoint_interval: float = 30.0  # seconds between in-flight checkpoints
    max_errors: int | None = None  # stop (exit 1) once this many rows have failed
    retry_errors: bool = False  # redo committed rows with an error (not part of the job's identity)
    # --task score: the column whose text is scored after the prompt (conditional); None: the whole prompt
    score_column: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.input, str):
            self.input = [self.input]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.input = [str(p) for p in self.input]
        self.stop = list(self.stop or [])
        if isinstance(self.choices, str):
            self.choices = [c.strip() for c in self.choices.split(",")]
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        # the sampling values go through sampling.check_number (sampling_params, below), like every row's own
        if not isinstance(self.checkpoint_interval, float) or not math.isfinite(self.checkpoint_interval):
            self.checkpoint_interval = _finite_float("checkpoint_interval", self.checkpoint_interval)
        modes = [n for n in ("prompt_column", "messages_column", "template") if getattr(self, n) is not None]
        if len(modes) > 1:
            raise ConfigError(f"give only one of --prompt-column, --messages-column, --template; got {modes}")
        for name, _, opt in job_options():  # the engine's own checks (engine/config.py)
            wrong = opt.complaint(name, getattr(self, name))
            if wrong is not None:
                raise ConfigError(wrong)
        if self.admission not in ADMISSION_CHOICES:
            raise ConfigError(
                f"admission must be one of {', '.join(ADMISSION_CHOICES)}; got {self.admission!r}"
            )
        self.template_kwargs = self._template_kwargs()
        if self.reasoning_tags is not None:
            from batchjob.job.reasoning import parse_tags

            parse_tags(self.reasoning_tags)
        if self.max_reasoning_tokens is not None and self.max_reasoning_tokens < 1:
            raise ConfigError(f"max_reasoning_tokens must be >= 1, got {self.max_reasoning_tokens!r}")
        if self.format not in FORMAT_CHOICES:
            raise ConfigError(f"format must be one of {', '.join(FORMAT_CHOICES)}; got {self.format!r}")
        if self.format == "openai":
            given = [
                n
                for n in ("prompt_column", "messages_column", "template", "params_column")
                if getattr(self, n) is not None
            ]
            if given:
                raise ConfigError(
                    f"--format openai takes the prompt and parameters from each request's body; leave out "
                    f"{', '.join('--' + g.replace('_', '-') for g in given)}"
                )
            if self.id_column not in (None, "custom_id"):
                raise ConfigError(
                    "--format openai: the row id is each request's custom_id; leave out --id-column"
                )
            self.id_column = "custom_id"
        if self.lookahead < 1:
            raise ConfigError(f"lookahead must be >= 1 rows, got {self.lookahead!r}")
        if not self.checkpoint_interval > 0:
            raise ConfigError(f"checkpoint_interval must be > 0 seconds, got {self.checkpoint_interval!r}")
        if self.max_errors is not None and self.max_errors < 1:
            raise ConfigError(f"max_errors must be >= 1, got {self.max_errors!r}")
        self._check_task()
        self._schema_text = self._load_schema()
        self.sampling_params(0)  # validates the sampling options: the one numeric check, the constraints

    def _check_task(self) -> None:
        """Refuse, before any work, the options that mean nothing for the job's task, naming them."""
        task = self.task
        if task == "generate":
            owners = {
                "pooling": "embed",
                "normalize": "embed",
                "dimensions": "embed",
                "score_column": "score",
            }
            wrong = [n for n in owners if getattr(self, n) is not None] + (
                ["truncate"] if self.truncate else []
            )
            if wrong:
                name = wrong[0]
                owner = owners.get(name, "embed, classify or score")
                raise ConfigError(
                    f"{_flags([name])} is an option of --task {owner}; this job generates text (--task "
                    f"generate): give --task {owner.split(',')[0]}, or leave {_flags([name])} out"
                )
            return
        defaults = {
            f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(self)
        }
        given = [n for n in GENERATION_ONLY if getattr(self, n) != defaults[n]]
        if task != "score" and self.logprobs is not None:
            given.append("logprobs")
        if task != "embed":
            given += [n for n in ("pooling", "normalize", "dimensions") if getattr(self, n) is not None]
        if task != "score" and self.score_column is not None:
            given.append("score_column")
        if given:
            raise ConfigError(
                f"{_flags(given)} {'has' if len(given) == 1 else 'have'} no meaning for --task {task} "
                f"(it computes {TASK_RESULTS[task]} in one forward, without generating); leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        if self.format != "rows" and task != "embed":
            raise ConfigError(
                f"--format {self.format} is for --task generate (chat and completions requests) and embed "
                f"(/v1/embeddings requests); --task {task} reads rows"
            )
        if self.logprobs is not None and self.logprobs != 0:
            raise ConfigError(
                f"--task score: --logprobs takes no K (got {self.logprobs}); it adds the token_logprobs "
                "column, one log-probability per scored token"
            )
        if self.score_column is not None and self.score_column in (
            self.prompt_column,
            self.messages_column,
        ):
            raise ConfigError(
                f"--score-column {self.score_column!r} is also the prompt's column; the scored text comes "
                "after the prompt, from a column of its own"
            )

    def _load_schema(self) -> str | None:
        if self.json_schema is None:
            return None
        path = Path(self.json_schema).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"json_schema file {path} cannot be read: {getattr(e, 'strerror', None) or e}"
            ) from e

    def _template_kwargs(self) -> dict[str, Any]:
        value = self.chat_template_kwargs
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
                raise ConfigError(
                    f"chat_template_kwargs must be a JSON object, got {value[:200]!r} ({why})"
                ) from e
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"chat_template_kwargs must be a JSON object, got {value!r}")
        return value

    @property
    def effective_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 1.0 if self.format == "openai" else 0.0  # labels want the same answer twice; OpenAI samples

    @property
    def per_row_params(self) -> bool:
        """Whether rows bring their own sampling parameters (which then fill in the job's)."""
        return self.params_column is not None or self.format == "openai"

    def sampling_params(self, job_seed: int) -> SamplingParams:
        """The sampling params of every request (with per-row parameters: what a row leaves out);
        ``job_seed`` stands in when no ``seed`` was given."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.effective_temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed if self.seed is not None else job_seed,
            stop=self.stop or None,
            choices=self.choices,
            json_schema=self._schema_text,
            regex=self.regex,
            logprobs=self.logprobs,
            n=self.n,
        )

    def engine_options(self) -> dict[str, Any]:
        """The job's engine settings as ``EngineConfig`` (and ``Engine.from_pretrained``) name them."""
        options = {f.name: getattr(self, name) for name, f, _ in job_options()}
        options["static_batching"] = self.admission == "static"
        # A job always wants a pool that fits one request of the full context, however it was sized: a
        # smaller one would turn rows into errors for a reason that is about the setup, not the row.
        options["check_kv_pool"] = True
        return options

    def require_io(self) -> None:
        if not self.input:
            raise ConfigError("no input: give --input PATH (or input = ... in the job file)")
        if not self.output:
            raise ConfigError("no output: give --output DIR (or output = ... in the job file)")

    def prompt_fingerprint(self) -> dict[str, Any]:
        keys = ("prompt_column", "messages_column", "template", "system", "chat", "id_column")
        out = {k: getattr(self, k) for k in keys}
        if self.format != "rows":
            out["format"] = self.format
        if self.params_column is not None:  # per-row parameters: the rows themselves are identified
            out["params_column"] = self.params_column
        if self.template_kwargs:
            out["chat_template_kwargs"] = self.template_kwargs
        if self.reasoning_tags is not None:
            out["reasoning_tags"] = self.reasoning_tags
        return out

    def task_fingerprint(self) -> dict[str, Any]:
        """The task and its options (empty for generation, so a generation job keeps its identity)."""
        if self.task == "generate":
            return {}
        out: dict[str, Any] = {"task": self.task, "truncate": self.truncate}
        if self.task == "embed":
            out |= {"pooling": self.pooling, "normalize": self.normalize, "dimensions": self.dimensions}
        if self.task == "score":
            out |= {"score_column": self.score_column, "token_logprobs": self.logprobs is not None}
        if self.max_model_len is not None:  # it cuts (with --truncate) or fails long texts
            out["max_model_len"] = self.max_model_len
        return out

    def sampling_fingerprint(self) -> dict[str, Any]:
        if self.task != "generate":
            return {}  # nothing is sampled: the task's identity is task_fingerprint()
        keys = ("max_new_tokens", "top_p", "top_k", "min_p", "seed", "stop")
        out = {k: getattr(self, k) for k in keys} | {"temperature": self.effective_temperature}
        # Constraints and samples only when given, so a job without them keeps its old identity.
        extra = self.sampling_params(0).to_dict()
        for k in ("choices", "json_schema", "regex", "logprobs", "n"):
            if k in extra:
                out[k] = extra[k]  # the schema's content, not its path
        if self.max_model_len is not None:  # it cuts long outputs short (finish_reason "length")
            out["max_model_len"] = self.max_model_len
        if self.max_reasoning_tokens is not None:
            out["max_reasoning_tokens"] = self.max_reasoning_tokens
        return out


# What each task computes, in words (messages).
TASK_RESULTS = {
    "embed": "an embedding",
    "classify": "a classifier head's scores",
    "score": "the text's log-likelihood",
}
# Options that only generation has: refused (when given) with the other tasks.
GENERATION_ONLY = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "choices",
    "json_schema",
    "regex",
    "n",
    "max_reasoning_tokens",
    "reasoning_tags",
    "params_column",
    "num_speculative_tokens",
)


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def _finite_float(name: str, value: Any) -> float:
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return number


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
}


def _check_type(name: str, value: Any, annotation: Any) -> None:
    text = str(annotation)
    if value is None:
        if "None" in text:
            return
        raise ConfigError(f"{name} must be given, got nothing")
    if text.startswith("list"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} must be a list of strings, got {value!r}")
        return
    base = text.split(" | ")[0]
    ok = _TYPES.get(base, (object,))
    if isinstance(value, bool) and base != "bool" or not isinstance(value, ok):
        raise ConfigError(f"{name} must be {'a' if base != 'int' else 'an'} {base}, got {value!r}")


FIELD_NAMES = {f.name for f in dataclasses.fields(JobSpec)}


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The fields of a TOML job file, keys normalized to underscores, paths made relative to its folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"job file {path} is not valid TOML: {e}") from e
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}  # field name -> the key that gave it
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELD_NAMES:
            raise ConfigError(
                f"job file {path}: unknown field {key!r} (known: {', '.join(sorted(FIELD_NAMES))})"
            )
        if name in keys:
            raise ConfigError(
                f"job file {path}: {keys[name]!r} and {key!r} are the same field; keep only one of them"
            )
        keys[name] = key
        out[name] = value
    base = path.parent

    def rel(p: Any) -> Any:
        if isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute():
            return str(base / p)
        return p

    if "input" in out:
        out["input"] = [rel(p) for p in out["input"]] if isinstance(out["input"], list) else rel(out["input"])
    if "output" in out:
        out["output"] = rel(out["output"])
    if "json_schema" in out:
        out["json_schema"] = rel(out["json_schema"])
    model = out.get("model")
    if isinstance(model, str) and (model.startswith(("./", "../")) or _is_folder(rel(model))):
        out["model"] = rel(
            model
        )  # a folder next to the job file (else: the working directory's, or a hub id)
    return out


def _is_folder(path: Any) -> bool:
    try:
        return isinstance(path, str) and "://" not in path and Path(path).expanduser().is_dir()
    except OSError:  # a name too long for a path, say: not a folder
        return False


def make_spec(job_file: str | Path | None = None, **overrides: Any) -> JobSpec:
    """A spec from a job file (optional) with ``overrides`` (the command line's given options) on top."""
    fields = load_job_file(job_file) if job_file is not None else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return JobSpec(**fields)
    except TypeError as e:  # pragma: no cover - unknown keys are caught above
        raise ConfigError(str(e)) from e
