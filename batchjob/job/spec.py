"""A job's specification: every option of ``batchjob run`` in one validated dataclass, and TOML job files.

Each job option is declared once, as a field of ``JobSpec`` made by ``job_option()`` (``options.py``): its
name is the TOML key (``max_new_tokens`` or ``max-new-tokens``) and the flag (``--max-new-tokens``), with its
default, help and check. The engine's options are declared in ``engine/options.py``, and ``JobSpec`` gets a
field for each (same name, default and check; ``None``: the engine decides). The fields' order is the order
of ``batchjob run --help``.

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
from dataclasses import Field, dataclass
from pathlib import Path
from typing import Any

from batchjob.engine.options import Option, job_options
from batchjob.engine.tasks.state import TASK_CHUNK
from batchjob.errors import ConfigError
from batchjob.job.admission import ADMISSION_CHOICES
from batchjob.job.options import JobOption, at_least, job_option, one_of, positive
from batchjob.models import DEFAULT_MODEL
from batchjob.sampling import SamplingParams

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
FORMAT_CHOICES = ("rows", "openai")
ENGINE_OPTIONS_BEFORE = "admission"  # the engine's options come just before this job option


def _with_engine_options(cls: type) -> type:
    """Give the (not yet dataclass) ``cls`` a field per engine option jobs have, as ``engine/options.py``
    declares it: its job name (``prefix_caching`` for ``enable_prefix_caching``), type, default and
    declaration; placed before the field ``ENGINE_OPTIONS_BEFORE``, as the command line lists them."""
    own = list(cls.__annotations__.items())
    at = next(i for i, (name, _) in enumerate(own) if name == ENGINE_OPTIONS_BEFORE)
    engine = []
    for name, f, opt in job_options():
        engine.append((name, opt.kind.__name__ + (" | None" if f.default is None else "")))
        setattr(cls, name, dataclasses.field(default=f.default, metadata={"option": opt}))
    cls.__annotations__.clear()
    cls.__annotations__.update(own[:at] + engine + own[at:])
    return cls


@dataclass
@_with_engine_options
class JobSpec:
    """What to run: each field is a job option, declared once (``job_option``: default, help, check), and is
    the same-named key of job files and flag of ``batchjob run``. Temperature defaults to 0: greedy,
    reproducible.

    Besides the fields below, one per engine option (``engine/options.py``, by their job names), between
    ``n`` and ``admission``: ``device``, ``dtype``, ``attention_backend``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``block_size``, ``kv_memory_gb``, ``num_blocks``, ``max_model_len``,
    ``gpu_memory_utilization``, ``prefix_caching``, ``num_speculative_tokens``, ``cuda_graphs``, ``compile``,
    and the task's: ``task``, ``pooling``, ``normalize``, ``dimensions``, ``truncate``.
    """

    # inputs and outputs
    input: list[str] = job_option(
        list,
        "Input file, folder or glob (repeatable): .parquet, .jsonl[.gz|.zst], a datasets.save_to_disk folder, "
        "or s3:// gs:// hf:// with fsspec installed.",
        metavar="PATH",
        multiple=True,
    )
    output: str | None = job_option(
        None, "Output folder: Parquet parts, state under DIR/_batchjob.", metavar="DIR"
    )
    # prompt construction: at most one of prompt_column, messages_column, template
    prompt_column: str | None = job_option(
        None, "Column whose text is the prompt", default_help="'prompt' or 'text'", metavar="COL"
    )
    messages_column: str | None = job_option(None, "Column holding a list of chat messages.", metavar="COL")
    template: str | None = job_option(
        None, 'Prompt format string over columns, e.g. "Classify: {review}".', metavar="FMT"
    )
    system: str | None = job_option(None, "System message put before each prompt.", metavar="TEXT")
    chat: bool | None = job_option(
        None,
        "Wrap each prompt as a user message in the chat template",
        default_help="on when the tokenizer has a chat template",
    )
    id_column: str | None = job_option(
        None, "Column of unique row ids", default_help="'<file>:<row>'", metavar="COL"
    )
    format: str = job_option(
        "rows",
        "rows: each input row is a record with columns; openai: each line is an OpenAI Batch API request "
        "(custom_id, method, url, body), its body giving the prompt and parameters",
        choices=FORMAT_CHOICES,
        check=one_of(FORMAT_CHOICES),
    )
    params_column: str | None = job_option(  # per-row sampling parameters (JSON object or struct)
        None,
        "Column of per-row sampling parameters: a JSON object (text or struct) such as "
        '{"max_new_tokens": 3, "temperature": 0.7}; what a row leaves out takes the job\'s options.',
        metavar="COL",
    )
    chat_template_kwargs: dict[str, Any] | str | None = job_option(  # a JSON object (or its text)
        None,
        "Keyword arguments for the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3).",
        metavar="JSON",
        cli_type=str,
    )
    reasoning_tags: str | None = job_option(
        None,
        "A reasoning model's think tags; the text between them goes to a reasoning column, the rest is the "
        "answer",
        default_help="found in its tokenizer, e.g. <think>,</think>",
        metavar="OPEN,CLOSE",
    )
    max_reasoning_tokens: int | None = job_option(
        None,
        "Close the thinking after N tokens; the answer (under --choices / --json-schema / --regex, and "
        "--max-new-tokens) comes after it.",
        check=at_least(1),
        metavar="N",
    )
    check_model_name: bool = job_option(
        False,
        "--format openai: a request whose body.model is not this job's model becomes an error row",
        default_help="the name is ignored, with one warning listing the names seen",
        switch=True,
    )
    # model
    model: str | None = job_option(
        None, "Local model folder or hub id", default_help=f"embedded {DEFAULT_MODEL}"
    )
    trust_remote_code: bool = job_option(  # not part of the job's identity
        False,
        "Let a model folder run the Python code its config's auto_map names",
        default_help="off: such a model is refused",
        switch=True,
    )
    # sampling (checked by SamplingParams, like every row's own)
    max_new_tokens: int = job_option(128, "Tokens to generate per row at most")
    temperature: float | None = job_option(
        None, "Sampling temperature; 0 is greedy", default_help="0; with --format openai, OpenAI's 1"
    )
    top_p: float = job_option(1.0, "Nucleus sampling threshold in (0, 1]")
    top_k: int = job_option(0, "Keep the k most likely tokens; 0 keeps all")
    min_p: float = job_option(0.0, "Drop tokens below min_p x the top probability")
    seed: int | None = job_option(None, "Sampling seed; each row mixes in its id", default_help="one per job")
    stop: list[str] = job_option(list, "Stop string (repeatable); the text is cut before it.", multiple=True)
    # constraints and samples
    choices: list[str] | None = job_option(  # "a,b,c" is split at commas
        None,
        "The answer is exactly one of these comma-separated labels (decoded under a token constraint); adds a "
        "choice_logprobs column: JSON {label: log-probability}.",
        metavar="A,B,C",
        cli_type=str,
    )
    json_schema: str | None = job_option(  # a path: the schema's content is part of the identity
        None, "The answer is compact JSON valid against the JSON schema in FILE.", metavar="FILE"
    )
    regex: str | None = job_option(None, "The answer matches this regular expression.", metavar="PATTERN")
    logprobs: int | None = job_option(
        None,
        "Add a logprobs column: per generated token, its log-probability and the top-K tokens' (K alone: 0). "
        "--task score: a token_logprobs column, the log-probability of each scored token.",
        metavar="[K]",
        flag_value=0,
    )
    score_column: str | None = job_option(
        None,
        "--task score: the column whose text is scored, as the prompt's continuation",
        default_help="the whole prompt is scored",
        metavar="COL",
    )
    n: int = job_option(
        1,
        "Samples per row: N result rows with a sample_index column; the prompt is computed once",
        metavar="N",
    )
    # (the engine's options come here)
    # admission (with --admission static, the engine's static_batching)
    admission: str = job_option(
        "fcfs",
        "Order rows enter the engine: input order, longest or shortest prompt first within --lookahead rows, "
        "or static batches (a baseline)",
        choices=ADMISSION_CHOICES,
        check=one_of(ADMISSION_CHOICES),
    )
    lookahead: int = job_option(
        512,
        "Rows read ahead for longest-first / shortest-first",
        check=at_least(1, " rows"),
        metavar="ROWS",
    )
    # state
    append: bool = job_option(
        False,
        "The inputs grew since the job ran (rows appended to JSONL files, new files): process the new rows, "
        "keep what is done. Any other change to the inputs is still refused.",
        switch=True,
    )
    checkpoint_interval: float = job_option(
        30.0,
        "Seconds between in-flight checkpoints",
        check=positive(" seconds"),
        metavar="SECONDS",
    )
    max_errors: int | None = job_option(
        None, "Stop (exit 1, state saved) once N rows failed.", check=at_least(1), metavar="N"
    )
    retry_errors: bool = job_option(  # not part of the job's identity
        False,
        "Redo the rows already written with an error (e.g. after raising --num-blocks); the same job, "
        "resumed, even when it was complete.",
        switch=True,
    )

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
        for f, opt in declared():  # each option's own check, the engine's (engine/options.py) included
            wrong = opt.complaint(f.name, getattr(self, f.name))
            if wrong is not None:
                raise ConfigError(wrong)
        self.template_kwargs = self._template_kwargs()
        if self.reasoning_tags is not None:
            from batchjob.job.reasoning import parse_tags

            parse_tags(self.reasoning_tags)
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
        # Where a row's chunks start (the engine's chunk grid): resuming with other chunks could change the
        # last bits of the floats written. Named only when not the defaults', so a job keeps its identity.
        chunk = min(TASK_CHUNK, self.max_num_batched_tokens or TASK_CHUNK)
        if chunk != TASK_CHUNK or self.block_size is not None:
            out["chunks"] = {"tokens": chunk, "block_size": self.block_size}
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


FIELD_NAMES = {f.name for f in dataclasses.fields(JobSpec)}  # a job file's keys (or with - for _)


def declared() -> list[tuple[Field[Any], JobOption | Option]]:
    """Every option of a job, in order: ``JobSpec``'s fields with their declarations (``JobOption`` for the
    job's own, ``Option`` for the engine's)."""
    return [(f, f.metadata.get("job_option") or f.metadata["option"]) for f in dataclasses.fields(JobSpec)]


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
