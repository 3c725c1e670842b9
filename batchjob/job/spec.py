"""A job's specification: every option of ``batchjob run`` in one validated dataclass, ``JobSpec``.

Each job option is declared once, as a field of ``JobSpec`` made by ``job_option()`` (``options.py``): its
name is the TOML key (``max_new_tokens`` or ``max-new-tokens``) and the flag (``--max-new-tokens``), with its
default, help and check. The engine's options are declared in ``engine/options.py`` and held as one typed
object, ``JobSpec.engine`` (an ``EngineOptions``, which the engine is built from); job files and flags keep
their flat job names (``max_num_seqs``, ``prefix_caching`` for ``enable_prefix_caching``), which
``make_spec`` maps into that object. ``declared()`` lists every option by its job name, in the order of
``batchjob run --help``: the job's own, with the engine's between ``n`` and ``admission``.

Job files are read by ``jobfile.py``; the checks that need no spec (types, the task's options) are
``checks.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import Field, dataclass, field
from pathlib import Path
from typing import Any

from batchjob.engine.options import EngineOptions, Option, by_engine_name, job_options
from batchjob.errors import ConfigError
from batchjob.job.admission import ADMISSION_CHOICES
from batchjob.job.checks import (
    annotation,
    check_task,
    check_type,
    check_unused,
    choice_scoring,
    finite_float,
    home,
    image_options_given,
)
from batchjob.job.jobfile import overlay, read_job_file
from batchjob.job.lora import lora_paths
from batchjob.job.options import JobOption, at_least, job_option, one_of, positive
from batchjob.job.templates import template_kwargs
from batchjob.models import DEFAULT_MODEL
from batchjob.sampling import SamplingParams, greedy_samples

FORMAT_CHOICES = ("rows", "openai")
# Pillow's Image.MAX_IMAGE_PIXELS, its decompression-bomb warning (not imported)
PILLOW_MAX_PIXELS = 89_478_485


@dataclass
class JobSpec:
    """What to run: each field is a job option, declared once (``job_option``: default, help, check), and is
    the same-named key of job files and flag of ``batchjob run``. Temperature defaults to 0: greedy,
    reproducible.

    ``engine`` holds the engine's options (``engine/options.py``; by their job names in job files and on the
    command line: ``device``, ``dtype``, ``max_num_seqs``, ``prefix_caching``, ``task``, ``pooling``, ...),
    checked like the job's own; the job sets its ``static_batching`` (``--admission static``) and
    ``check_kv_pool`` itself.
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
        None,
        'Prompt format string over columns, e.g. "Classify: {review}". On the command line \\n and \\t are '
        "a newline and a tab (\\\\ a backslash), as in a job file's string.",
        metavar="FMT",
    )
    system: str | None = job_option(
        None,
        "System message put before each prompt (\\n and \\t read as for --template).",
        metavar="TEXT",
    )
    image_column: str | None = job_option(
        None,
        "Column of each row's images (a vision-language model): one or a list, each bytes, a {bytes, path} "
        "struct or a path (relative to the input file's folder); they come before the row's text.",
        metavar="COL",
    )
    max_image_pixels: int = job_option(
        PILLOW_MAX_PIXELS,
        "An image with more pixels than this is its row's error (a decompression bomb)",
        check=at_least(1, " pixels"),
        metavar="N",
    )
    allow_remote_images: bool = job_option(  # not part of the job's identity (its images' bytes are)
        False,
        "Fetch images named by a URL (http(s)://, or s3://, gs://, hf://... with fsspec's package for it), "
        "once a run (30 s timeout), recorded by content as a path is",
        default_help="off: such an image is its row's error",
    )
    image_workers: int | None = job_option(
        None,
        "Threads that decode and preprocess image rows ahead of the engine (0: on the job's main thread)",
        default_help="one a CPU, at most 4",
        check=at_least(0),
        metavar="N",
    )
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
    )
    # model
    model: str | None = job_option(
        None, "Local model folder or hub id", default_help=f"embedded {DEFAULT_MODEL}"
    )
    trust_remote_code: bool = job_option(  # not part of the job's identity
        False,
        "Let a model folder run the Python code its config's auto_map names",
        default_help="off: such a model is refused",
    )
    lora: list[str] = job_option(  # a job file's [lora] table {name = path} comes as NAME=PATH entries
        list,
        "A LoRA adapter to hold resident, NAME=PATH (repeatable): a PEFT folder (adapter_config.json and "
        "adapter_model.safetensors) or hub id; rows pick one by --adapter-column, or with one adapter and no "
        "column every row takes it. Results get an adapter column.",
        metavar="NAME=PATH",
        multiple=True,
    )
    adapter_column: str | None = job_option(
        None, "Column naming each row's LoRA adapter (null or empty: the base model).", metavar="COL"
    )
    # sampling (checked by SamplingParams, like every row's own)
    max_new_tokens: int = job_option(128, "Tokens to generate per row at most")
    temperature: float | None = job_option(
        None, "Sampling temperature; 0 is greedy", default_help="0; with --format openai, OpenAI's 1"
    )
    top_p: float = job_option(1.0, "Nucleus sampling threshold in (0, 1]")
    top_k: int = job_option(0, "Keep the k most likely tokens; 0 keeps all")
    min_p: float = job_option(0.0, "Drop tokens below min_p x the top probability")
    repetition_penalty: float | None = job_option(
        None,
        "HF's repetition penalty on the tokens already in the context (prompt and output); 1 is none",
        default_help="the model's generation_config.json's, as transformers' generate, else 1",
    )
    seed: int | None = job_option(None, "Sampling seed; each row mixes in its id", default_help="one per job")
    stop: list[str] = job_option(list, "Stop string (repeatable); the text is cut before it.", multiple=True)
    # constraints and samples
    choices: list[str] | None = job_option(  # "a,b,c" is split at commas
        None,
        "The answer is exactly one of these comma-separated labels (decoded under a token constraint); adds "
        "the columns choice_logprobs and choice_probs: maps {label: log-probability} and {label: probability}. "
        "Repeatable: the labels of each are joined.",
        metavar="A,B,C",
        cli_type=str,
        multiple=True,
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
    # the engine's options: the flags and job file keys between --n and --admission (``declared()``)
    engine: EngineOptions = field(default_factory=EngineOptions)
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
    )
    checkpoint_interval: float = job_option(
        30.0,
        "Seconds between in-flight checkpoints",
        check=positive(" seconds"),
        metavar="SECONDS",
    )
    max_errors: int | None = job_option(
        None,
        "Stop (exit 1, state saved) once N rows of the job failed (with several workers, all of theirs).",
        check=at_least(1),
        metavar="N",
    )
    retry_errors: bool = job_option(  # not part of the job's identity
        False,
        "Redo the rows already written with an error (e.g. after raising --num-blocks); the same job, "
        "resumed, even when it was complete.",
    )

    def __post_init__(self) -> None:
        values = checked(self.values())  # the same checks, in the same order, as make_spec's
        self.input, self.stop, self.choices = values["input"], values["stop"], values["choices"]
        self.output = values["output"]
        self.lora = values["lora"]
        self.checkpoint_interval = values["checkpoint_interval"]
        # A job always wants a pool that fits one request of the full context, however it was sized: a
        # smaller one would turn rows into errors for a reason that is about the setup, not the row.
        self.engine = dataclasses.replace(
            self.engine, static_batching=self.admission == "static", check_kv_pool=True
        )
        self.template_kwargs = template_kwargs(self.chat_template_kwargs)
        self.lora_paths = lora_paths(self.lora, self.adapter_column, self.format, self.model)
        if self.reasoning_tags is not None:
            from batchjob.job.reasoning import parse_tags

            parse_tags(self.reasoning_tags)
        if self.format == "openai":
            self._check_openai()
        if self.image_column is not None and (self.format != "rows" or self.engine.task != "generate"):
            raise ConfigError("--image-column is for generation over rows (not --format openai, not --task)")
        check_task(self.values(), _DEFAULTS)
        self._schema_text = self._load_schema()
        self.sampling_params(0)  # validates the sampling options: the one numeric check, the constraints
        check_unused(self.values(), PILLOW_MAX_PIXELS)  # after: a bad value is named as bad, not as unused

    def _check_openai(self) -> None:
        """``--format openai``: the prompt, parameters and id come from each request."""
        names = ("prompt_column", "messages_column", "template", "params_column")
        given = [n for n in names if getattr(self, n) is not None]
        if given:
            raise ConfigError(
                f"--format openai takes the prompt and parameters from each request's body; leave out "
                f"{', '.join('--' + g.replace('_', '-') for g in given)}"
            )
        if self.chat is not None:  # ignored: each request's kind (messages or a prompt) says it
            raise ConfigError(
                "--format openai: a chat request's messages go through the chat template and a completions "
                "request's prompt does not; leave out --chat/--no-chat"
            )
        if self.id_column not in (None, "custom_id"):
            raise ConfigError(
                "--format openai: the row id is each request's custom_id; leave out --id-column"
            )
        self.id_column = "custom_id"

    @property
    def image_options(self) -> list[str]:
        """The image options given: --max-image-pixels, --allow-remote-images, --image-workers (job names)."""
        return image_options_given(self.values(), PILLOW_MAX_PIXELS)

    def values(self) -> dict[str, Any]:
        """Every option of the job by its job name (the engine's from ``engine``), in ``declared()`` order."""
        engine = {name: getattr(self.engine, f.name) for name, f, _ in job_options()}
        return {name: engine[name] if name in engine else getattr(self, name) for name, _, _ in declared()}

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
        ``job_seed`` stands in when no ``seed`` was given. With per-row parameters, ``--n`` above 1 at
        temperature 0 is left to the rows, which may give their own temperature (or n): a row that leaves
        both out is that row's error (job/requests.py), so the base is built at n 1 and given n after."""
        temperature = self.effective_temperature
        to_rows = self.per_row_params and greedy_samples(self.n, temperature) is not None
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed if self.seed is not None else job_seed,
            stop=self.stop or None,
            choices=self.choices,
            json_schema=self._schema_text,
            regex=self.regex,
            logprobs=self.logprobs,
            n=1 if to_rows else self.n,
        )
        params.n = self.n  # (an attribute set is not checked: only the constructor refuses greedy samples)
        return params

    def require_io(self) -> None:
        if not self.input:
            raise ConfigError("no input: give --input PATH (or input = ... in the job file)")
        if not self.output:
            raise ConfigError("no output: give --output DIR (or output = ... in the job file)")

    def prompt_fingerprint(self) -> dict[str, Any]:
        keys = ("prompt_column", "messages_column", "template", "system", "chat", "id_column")
        out = {k: getattr(self, k) for k in keys}
        optional = {  # named only when given, so a job without them keeps its identity
            "format": None if self.format == "rows" else self.format,
            "params_column": self.params_column,  # per-row parameters: the rows themselves are identified
            "chat_template_kwargs": self.template_kwargs or None,
            "reasoning_tags": self.reasoning_tags,
            "adapter_column": self.adapter_column,  # which row takes which adapter
            "check_model_name": self.check_model_name or None,  # a request for another model: an error row
        }
        out |= {k: v for k, v in optional.items() if v is not None}
        # images: an image column's, or the image parts of OpenAI requests or a messages column (named when
        # the bound is not the default, so that a job without it keeps its identity)
        if self.image_column is not None or self.max_image_pixels != PILLOW_MAX_PIXELS:
            out |= {"image_column": self.image_column, "max_image_pixels": self.max_image_pixels}
        return out

    def sampling_fingerprint(self) -> dict[str, Any]:
        if self.engine.task != "generate":
            return {}  # nothing is sampled: the task's identity is job/tasks.py's task_fingerprint()
        keys = ("max_new_tokens", "top_p", "top_k", "min_p", "seed", "stop")
        out = {k: getattr(self, k) for k in keys} | {"temperature": self.effective_temperature}
        # Constraints and samples only when given, so a job without them keeps its old identity.
        extra = self.sampling_params(0).to_dict()
        for k in ("choices", "json_schema", "regex", "logprobs", "n", "repetition_penalty"):
            if k in extra:
                out[k] = extra[k]  # the schema's content, not its path
        sampled = self.effective_temperature > 0 or self.per_row_params
        scoring = choice_scoring(
            extra.get("choices"), "logprobs" in extra, self.params_column is not None, sampled
        )
        if scoring is not None:
            out["choice_scoring"] = scoring  # a job an earlier batchjob started is not resumed
        if self.engine.max_model_len is not None:  # it cuts long outputs short (finish_reason "length")
            out["max_model_len"] = self.engine.max_model_len
        if self.max_reasoning_tokens is not None:
            out["max_reasoning_tokens"] = self.max_reasoning_tokens
        return out


def declared() -> list[tuple[str, Field[Any], JobOption | Option]]:
    """Every option of a job, in order, as ``(job name, field, declaration)``: ``JobSpec``'s own fields
    (``JobOption``), with the engine's (``EngineOptions``' fields, ``Option``) in place of ``engine``."""
    out: list[tuple[str, Field[Any], JobOption | Option]] = []
    for f in dataclasses.fields(JobSpec):
        if f.name == "engine":
            out += job_options()
        else:
            out.append((f.name, f, f.metadata["job_option"]))
    return out


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_DEFAULTS = {name: _default(f) for name, f, _ in declared()}  # each option's default, by its job name
FIELD_NAMES = set(_DEFAULTS)  # a job file's keys (or with - for _)
# fields that exclude each other: one of a group given on the command line replaces the job file's
EXCLUSIVE = (("prompt_column", "messages_column", "template"), ("choices", "json_schema", "regex"))
ENGINE_NAMES = {name for name, _, _ in job_options()}  # the engine's options, by their job names


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The fields of a TOML job file, keys normalized to underscores, paths made relative to its folder."""
    return read_job_file(path, FIELD_NAMES)


def checked(values: dict[str, Any]) -> dict[str, Any]:
    """A job's options (``values``: each by its job name, as ``JobSpec.values()`` gives them) normalized
    (``input`` and ``stop`` lists, ``choices`` split at commas, ``checkpoint_interval`` a float) and checked,
    each against its type and then its declaration's check, in ``declared()`` order; raises ``ConfigError``
    for the first that is wrong. ``make_spec`` runs it on the flat values before it builds the engine's
    object, and ``JobSpec`` again on its own, so a job reports the same first error however it is made."""
    values = dict(values)
    if isinstance(values["lora"], dict):  # a job file's [lora] table
        values["lora"] = [f"{k}={v}" for k, v in values["lora"].items()]
    for name in ("input", "stop"):  # one string or a list of them (a job file's other types named here)
        value = values[name]
        if isinstance(value, (str, Path)):
            values[name] = [value]
        elif value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a string or a list of strings, got {value!r}")
    values["input"] = [home(str(p)) if isinstance(p, (str, Path)) else p for p in values["input"]]  # ~: home
    values["output"] = home(values["output"])
    values["stop"] = list(values["stop"] or [])
    if isinstance(values["choices"], str):
        values["choices"] = [c.strip() for c in values["choices"].split(",")]
    for name, f, opt in declared():
        check_type(name, values[name], annotation(f, opt))
    # the sampling values go through sampling.check_number (sampling_params, below), like every row's own
    interval = values["checkpoint_interval"]
    if not isinstance(interval, float) or not math.isfinite(interval):
        values["checkpoint_interval"] = finite_float("checkpoint_interval", interval)
    modes = [n for n in ("prompt_column", "messages_column", "template") if values[n] is not None]
    if len(modes) > 1:
        raise ConfigError(f"give only one of --prompt-column, --messages-column, --template; got {modes}")
    for name, _, opt in declared():  # each option's own check, the engine's (engine/options.py) included
        wrong = opt.complaint(name, values[name])
        if wrong is not None:
            raise ConfigError(wrong)
    return values


def make_spec(job_file: str | Path | None = None, **overrides: Any) -> JobSpec:
    """A spec from a job file (optional) with ``overrides`` (the command line's given options) on top; both
    name the engine's options flat, by their job names (``max_num_seqs``, ``prefix_caching``), which go
    into ``JobSpec.engine`` (over ``engine``, an ``EngineOptions``, when given)."""
    fields = load_job_file(job_file) if job_file is not None else {}
    fields = overlay(job_file, fields, overrides, EXCLUSIVE)  # the command line's member of a group wins
    base = fields.pop("engine", None) or EngineOptions()
    try:
        if any(k not in FIELD_NAMES for k in fields):  # Python's own words for the unknown keyword
            JobSpec(**{k: v for k, v in fields.items() if k not in FIELD_NAMES})
        values = checked(_DEFAULTS | {name: getattr(base, f.name) for name, f, _ in job_options()} | fields)
        engine = dataclasses.replace(base, **by_engine_name({k: values[k] for k in ENGINE_NAMES}))
        return JobSpec(engine=engine, **{k: v for k, v in fields.items() if k not in ENGINE_NAMES})
    except TypeError as e:  # a caller's unknown keyword (a job file's are caught in load_job_file)
        raise ConfigError(str(e)) from e
