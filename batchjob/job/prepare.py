"""Preparing a job: everything checked before any work, and without the model's weights.

The output folder, the inputs (discovered, and against the saved job: grown, changed, new files that don't
fit), the prompt plan against the input's columns, and the job's identity (``fingerprint``: the model by
content, the prompts, the sampling, the split) against the saved one. The inputs are discovered and the model
identified once per start; ``reload`` checks the same start again against a job.json another worker wrote.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchjob.errors import BatchjobError, InputError, StateError
from batchjob.io.schema import compatible, input_schema
from batchjob.io.sources import Skipped, Source, discover
from batchjob.job import model_identity
from batchjob.job.checks import check_unused, greedy_only, unused_options
from batchjob.job.defaults import resolved_defaults, same_dtype
from batchjob.job.ids import check_unique
from batchjob.job.inputs import InputChangedError, named_as_recorded, new_records, ordered_sources, reconcile
from batchjob.job.kernels import generation_kernels, kernel_changes
from batchjob.job.kernels import without as without_kernels
from batchjob.job.lora import lora_identity
from batchjob.job.owned import check_output
from batchjob.job.prompts import PromptPlan, check_column_types, plan_prompts
from batchjob.job.rows.images import check_plan
from batchjob.job.templates import reads_narrow_float

if TYPE_CHECKING:
    from batchjob.job.images import CellRefs
from batchjob.job.shard import Shard, choose_chunk_rows
from batchjob.job.spec import PILLOW_MAX_PIXELS, JobSpec
from batchjob.job.state import (
    STATE_DIR,
    JobInfo,
    JobMismatchError,
    StateDir,
    differing,
    fingerprint_changes,
)
from batchjob.job.tasks import head_fingerprint, task_fingerprint


@dataclass
class Prepared:
    """Everything checked before any work: inputs, schema, prompt plan, identity, saved state."""

    spec: JobSpec
    out_dir: Path
    state: StateDir
    sources: list[Source]
    info: JobInfo  # saved (resume) or new
    resumed: bool
    plan: PromptPlan
    shard: Shard = field(default_factory=Shard)  # this worker's share, chunk_rows as saved with the job
    taken: list[str] = field(default_factory=list)  # --append: a line per grown or new input file
    model_check: dict[str, Any] | None = None  # a saved model identity to compare once the model is loaded
    found: list[Source] = field(default_factory=list)  # the input files discovered at the start
    fingerprint: dict[str, Any] = field(default_factory=dict)  # this start's identity, as computed
    skipped: list[Skipped] = field(default_factory=list)  # what the --input folders and globs left out
    redo: list[int] = field(default_factory=list)  # --append: ordinals of torn last rows finished since
    images: dict[str, str | None] | None = None  # --image-column: each referenced file's digest (images.py)
    remote: Any = None  # --allow-remote-images: the run's RemoteImages (remote_images.py), once recorded


def model_fingerprint(model: str | None) -> dict[str, Any]:
    """The model's identity by content (``model_identity.py``), whatever it is called."""
    from batchjob.models import resolve_model

    resolved = resolve_model(model)
    return model_identity.identity(model_identity.model_files(resolved), resolved, model)


def _model_entry(spec: JobSpec) -> dict[str, Any]:
    """The model by content and its dtype as given; ``auto`` also as what it resolves to here (``runs_in``,
    per device: a job started in float32 on the CPU would go on in bf16 on a GPU). ``_changes`` compares it
    where the saved job has it."""
    from batchjob.engine.config import resolve_device, resolve_dtype  # (torch: a run loads it anyway)

    entry: dict[str, Any] = {"identity": model_fingerprint(spec.model), "dtype": spec.engine.dtype}
    if spec.engine.dtype in (None, "auto"):
        with contextlib.suppress(BatchjobError):  # a bad device: the run itself says what is wrong with it
            device = resolve_device(spec.engine.device)
            entry["runs_in"] = str(resolve_dtype("auto", device)).removeprefix("torch.")
    return entry


def _check_output(out_dir: Path) -> None:
    check_output(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--output {out_dir} is a file, not a folder")
    existing = next((p for p in [out_dir, *out_dir.absolute().parents] if p.exists()), None)
    if existing is not None and existing != out_dir and not os.access(existing, os.W_OK):
        raise InputError(f"--output {out_dir} cannot be created: {existing} is not writable")
    if out_dir.is_dir() and not (out_dir / STATE_DIR).exists():
        visible = [e for e in out_dir.iterdir() if not e.name.startswith((".", "_"))]
        if visible:
            raise InputError(
                f"--output {out_dir} already holds other files (e.g. {visible[0].name}) and no batchjob job; "
                "give a new or empty folder"
            )
    _check_job_file(out_dir)


def _check_job_file(out_dir: Path) -> None:
    """Results without the job file that says what made them (deleted, or lost with a copy) would be taken
    for the results of whatever job runs there next: refused, before anything is written."""
    state = out_dir / STATE_DIR
    if not state.is_dir() or (state / "job.json").exists():
        return
    left = next(state.rglob("manifest.jsonl"), None) or next(out_dir.glob("*.parquet"), None)
    if left is not None:
        raise StateError(
            f"--output {out_dir} holds results ({left.relative_to(out_dir)}) but not the job file "
            f"{STATE_DIR}/job.json that says what made them: restore it from where the folder came from, or "
            "give a new --output"
        )


def task_entry(spec: JobSpec, model: dict[str, Any]) -> dict[str, Any]:
    """A task job's ``task`` entry: the task and its options, how its head is read, the score's log-softmax
    (``model``: the job's ``model`` entry, for the dtype it runs in)."""
    return task_fingerprint(spec) | head_fingerprint(spec) | _score_entry(spec, model)


def _score_entry(spec: JobSpec, model: dict[str, Any]) -> dict[str, Any]:
    """A score job that runs in bf16 (or float16) takes its log-probabilities in float32 since 2026-12-07
    (they were bf16's): its identity says so, and one an earlier batchjob started is not resumed into it."""
    runs = model.get("runs_in") or spec.engine.dtype
    halved = spec.engine.task == "score" and runs not in ("float32", "float64")
    return {"logsoftmax": "float32"} if halved else {}


def _render_entry(spec: JobSpec, plan: PromptPlan) -> dict[str, Any]:
    """A conversation rendered without the generation prompt (a task that reads it as it is) says so in the
    job's identity: such a job started when every render ended with one is refused on resume, by name,
    rather than written half one way and half the other (a job that renders no conversation is unchanged).
    So do the ways of rendering (``RENDERING``) that this batchjob's prompts take where an earlier one's
    took another, as the tags under ``rendering`` (present only where there are some)."""
    reads_as_is = plan.kind != "openai" and plan.chat and not plan.generation_prompt
    entry: dict[str, Any] = {"generation_prompt": False} if reads_as_is else {}
    tags = set()
    if plan.kind == "template" and plan.template and reads_narrow_float(plan.template, plan.types):
        tags.add("float32-fields")
    if plan.kind == "openai" and spec.engine.task != "embed":  # (which requests have text parts: not known)
        tags.add("openai-text-parts")
    if plan.kind == "messages" or (plan.kind == "openai" and plan.generation_prompt):
        tags.add("messages-v2")
    if _renders_image_conversations(spec, plan):
        tags.add("image-messages-v2")
    return entry | ({"rendering": sorted(tags)} if tags else {})


def _renders_image_conversations(spec: JobSpec, plan: PromptPlan) -> bool:
    """Whether the job's rows are conversations the processor's chat template renders: --image-column's
    (unless --no-chat), or a messages column's or --format openai's on a vision-language model (by its config;
    one that can't be read is no such model here: the run refuses it)."""
    if spec.image_column is not None:
        return spec.chat is not False
    if plan.kind not in ("messages", "openai"):
        return False
    from batchjob.engine.vision.family import is_vlm  # (no torch)
    from batchjob.models import load_config  # (transformers' config: only chat messages pay for it)

    with contextlib.suppress(BatchjobError):
        return bool(is_vlm(load_config(spec.model, spec.trust_remote_code)[0]))
    return False


# The ways this batchjob renders some prompts where an earlier batchjob rendered them otherwise, by the tag a
# job's identity lists under prompt.rendering: a job started before a tag was is refused on resume, saying why
RENDERING = {
    "float32-fields": "a --template field of a float32 or float16 column is written at its own precision, 0.1 "
    "where an earlier batchjob wrote its float64 widening 0.10000000149011612",
    "openai-text-parts": "a --format openai message's text parts are joined with a newline, as vLLM joins "
    "them, where an earlier batchjob joined them with nothing ('Paris is' and 'the capital' as 'Paris "
    "isthe capital')",
    "messages-v2": "chat messages (a messages column, or --format openai generating): a developer role is "
    "system, and an unknown role, empty content, a final assistant message (a messages column's) and a message "
    "the template drops are row errors, where an earlier batchjob rendered or answered them as given",
    "image-messages-v2": "a vision-language model's conversations (--image-column, a messages column, --format "
    "openai): a messages column's developer role is system, and its unknown roles, empty content and final "
    "assistant message, and a message the processor's template drops, are row errors, where an earlier "
    "batchjob rendered or answered them as given",
}


def _explained(line: str, saved: dict[str, Any], now: dict[str, Any]) -> str:
    """A ``prompt.rendering`` change with what each tag that differs means, and how to go on."""
    if not line.startswith("prompt.rendering:"):
        return line
    saved_tags, now_tags = (set(fp.get("prompt", {}).get("rendering") or ()) for fp in (saved, now))
    why = "; ".join(RENDERING.get(t, t) for t in sorted(saved_tags ^ now_tags))
    return (
        f"{line} ({why}): the job's rows were made one way and would go on the other; finish it with the "
        "batchjob that started it, or start it anew in another --output"
    )


def input_paths(spec: JobSpec) -> list[str]:
    """The --input values, local ones made absolute: where ``batchjob status`` looks at the inputs again."""
    return [p if "://" in p else os.path.abspath(os.path.expanduser(p)) for p in spec.input]


def _changes(spec: JobSpec, saved: dict[str, Any], now: dict[str, Any], kind: str) -> list[str]:
    """What differs between a saved job's fingerprint and this run's, in words (a default spelled out as
    what it surely resolves to is no difference: ``defaults.py``); ``kind``: its prompts' (``PromptPlan``)."""
    saved = {"sharding": {"num_shards": 1}} | saved
    model = model_identity.changes(saved.get("model", {}).get("identity", {}), now["model"]["identity"])

    def without_identity(fp: dict[str, Any]) -> dict[str, Any]:
        return fp | {"model": {"dtype": fp.get("model", {}).get("dtype")}}

    out = kernel_changes(saved, now)
    saved, now = without_kernels(saved), without_kernels(now)  # (compared apart: what to set back)
    a, b = _unrecorded(spec, without_identity(saved), without_identity(now), kind)
    if same_dtype(saved.get("model", {}), now["model"]):  # --dtype float32 where auto ran in it: one job
        b["model"]["dtype"] = a["model"]["dtype"]
    column = now.get("prompt", {}).get("resolved_column")
    defaults = resolved_defaults(spec, column) if differing(a, b) and not model else {}  # only a refusal pays
    runs = [fp.get("model", {}).get("runs_in") for fp in (saved, now)]
    out = ([model] if model else []) + out
    if None not in runs and runs[0] != runs[1]:
        out.append(f"model.dtype: 'auto' ran in {runs[0]}, is {runs[1]} here")
    return out + [_explained(line, saved, now) for line in fingerprint_changes(a, b, defaults)]


def _unrecorded(spec: JobSpec, saved: dict[str, Any], now: dict[str, Any], kind: str) -> tuple[dict, dict]:
    """The two fingerprints without what a job recorded before batchjob checked it, or for options it now
    refuses as unused (an older job resumes; neither is asked for again): --check-model-name over rows,
    --max-image-pixels without images (image parts on a text model's requests or messages included), --chat
    with --format openai or a messages column, --top-p, --top-k, --min-p and --seed where every row is
    greedy. (A task job's kernels recorded before it had them: ``kernels.recorded``.)"""
    unused = unused_options(spec.format, spec.image_column, kind, greedy_only(spec.values()))
    if kind == "messages":  # always rendered by the chat template: --no-chat is refused, once it was recorded
        unused.add("chat")
    pixels = [fp.get("prompt", {}).get("max_image_pixels") for fp in (saved, now)]
    if spec.image_column is None and pixels[0] != pixels[1] and _takes_no_images(spec):
        unused |= {"image_column", "max_image_pixels"}  # (both recorded where the bound was given)

    def used(fp: dict[str, Any], entry: str) -> dict[str, Any]:
        return {k: v for k, v in fp.get(entry, {}).items() if k not in unused}

    a, b = ({e: used(fp, e) for e in ("prompt", "sampling")} for fp in (saved, now))
    return saved | a, now | b


def _takes_no_images(spec: JobSpec) -> bool:
    """Whether the job's model is no vision-language model, by its config (False where it can't be read:
    the difference then stays one)."""
    from batchjob.engine.vision.family import is_vlm  # (no torch)
    from batchjob.models import load_config  # (transformers' config: only a difference pays for it)

    with contextlib.suppress(BatchjobError):
        return not is_vlm(load_config(spec.model, spec.trust_remote_code)[0])
    return False


def prepare(spec: JobSpec, has_chat_template: bool = True, shard: Shard | None = None) -> Prepared:
    """Check the job against its inputs and saved state, without loading the model.

    ``shard``: this worker's share of a job split over several workers (default: the whole job).
    ``has_chat_template``: what the plan assumes until the tokenizer is known (``PromptPlan.for_tokenizer``).
    """
    spec.require_io()
    shard = shard or Shard()
    out_dir = Path(spec.output)  # type: ignore[arg-type]
    _check_output(out_dir)
    skipped: list[Skipped] = []
    found = discover(spec.input, exclude=out_dir, skipped=skipped)
    state = StateDir(out_dir, shard)

    def identity(schema: pa.Schema) -> tuple[PromptPlan, dict[str, Any]]:
        plan = plan_prompts(spec, schema.names, has_chat_template, schema)
        check_column_types(spec, plan, schema)
        check_unused(spec.values(), PILLOW_MAX_PIXELS, plan.kind)  # the input's columns chose the prompts
        rendered = {"resolved_column": plan.column} | _render_entry(spec, plan)
        fingerprint = {
            "model": _model_entry(spec),
            "prompt": spec.prompt_fingerprint() | rendered,
            "sampling": spec.sampling_fingerprint(),
            "sharding": {"num_shards": shard.count},
        }
        if spec.lora_paths:  # each adapter by content, by name (a job without keeps its identity)
            fingerprint["lora"] = lora_identity(spec.lora_paths)
        if spec.engine.task != "generate":  # a generation job keeps the identity it had before tasks
            fingerprint["task"] = task_entry(spec, fingerprint["model"])
        return plan, fingerprint | generation_kernels(spec.engine)

    if spec.format == "openai":
        check_unique(found, "custom_id", "custom_id")  # OpenAI rejects such a file: so do we, before work
    if state.exists():
        return _with_images(replace(_resume(spec, state, found, shard, identity), skipped=skipped))
    schema = input_schema(found)
    records = new_records(found)
    sources = ordered_sources(found, records)
    plan, fingerprint = identity(schema)
    info = JobInfo(
        copy.deepcopy(fingerprint), random.getrandbits(62), schema, records, input_paths=input_paths(spec)
    )
    if not shard.single:
        info.chunk_rows = choose_chunk_rows(info.total_rows, shard.count)
        shard = replace(shard, chunk_rows=info.chunk_rows)
    return _with_images(
        Prepared(
            spec,
            out_dir,
            state,
            sources,
            info,
            False,
            plan,
            shard,
            found=found,
            fingerprint=fingerprint,
            skipped=skipped,
        )
    )


def _with_images(prep: Prepared) -> Prepared:
    """--image-column: the files its cells reference, by content (``record_images``); and those of the
    OpenAI image parts of a job that recorded some (the first run records them once the model is known)."""
    column = prep.spec.image_column
    if column is None:
        if prep.resumed and prep.state.images_file.exists():  # image parts, recorded by the first run
            from batchjob.job.rows.image_parts import refs_of

            return record_images(prep, refs_of(prep.spec, prep.plan))
        return prep
    from batchjob.job.images import column_refs

    check_plan(prep.spec, prep.plan)
    return record_images(prep, column_refs(column))


def record_images(prep: Prepared, cell_refs: CellRefs) -> Prepared:
    """``prep`` with the digests of the image files its rows name (``cell_refs``), checked against those
    the job recorded: a changed one refuses the resume, naming it, as a changed input does."""
    from batchjob.io.atomic import read_json
    from batchjob.job import images
    from batchjob.job.remote_images import RemoteImages, scheme

    remote = RemoteImages(prep.spec.max_image_pixels) if prep.spec.allow_remote_images else None
    now = images.scan(prep.sources, cell_refs, remote)
    saved: dict[str, str | None] = {}
    if prep.resumed and prep.state.images_file.exists():
        saved = read_json(prep.state.images_file)["images"]
        fetched = [name for name in saved if scheme(name) is not None]
        if fetched and remote is None:
            raise images.ImageChangedError(
                f"--output {prep.out_dir} holds a job that fetched remote images ({fetched[0]}"
                + (f" and {len(fetched) - 1} more" if len(fetched) > 1 else "")
                + "): pass --allow-remote-images to resume it"
            )
        changed = images.changes(saved, now)
        if changed:
            raise images.ImageChangedError(
                f"--output {prep.out_dir} holds a job whose image files changed:\n  "
                + "\n  ".join(changed[:20])
                + (f"\n  ... and {len(changed) - 20} more" if len(changed) > 20 else "")
                + "\nRestore them to resume, or use a new --output folder"
            )
    return replace(prep, images=now | {k: v for k, v in saved.items() if v is not None}, remote=remote)


def reload(prep: Prepared) -> Prepared:
    """``prep`` checked again against the job as saved now (another worker created it first, or took in
    new inputs): the same discovered inputs, plan and identity, not computed again."""
    return _resume(
        prep.spec, prep.state, prep.found, prep.shard, lambda schema: (prep.plan, prep.fingerprint)
    )


def _resume(
    spec: JobSpec,
    state: StateDir,
    found: list[Source],
    shard: Shard,
    identity: Callable[[pa.Schema], tuple[PromptPlan, dict[str, Any]]],
) -> Prepared:
    """Against a saved job: its inputs reconciled with what was found, its identity compared with this one."""
    out_dir = state.out_dir
    saved = state.load_job()
    found = named_as_recorded(saved.inputs, found)  # a name two --input values share now: the record's
    records, taken, redo = reconcile(saved.inputs, found, spec.append, out_dir)
    if redo and not shard.single:
        torn = [r for r in saved.inputs if r.ends_newline is False and any(o >> 40 == r.seq for o in redo)]
        raise InputChangedError(
            "\n  ".join(
                [f"the inputs of the job in {out_dir} grew over a last line written without a newline:"]
                + [f"{r.name}: its first {r.size} bytes end in the middle of a row" for r in torn]
            )
            + "\nA job split over several workers can't redo that row in place: cut each file back to that "
            "size (truncate -s SIZE FILE) and write the rest of the row and the new rows into a new file, "
            "which --append takes in"
        )
    known = {r.name for r in saved.inputs}
    misfits = [
        f"{s.path}: {why}"
        for s in found
        if s.name not in known and (why := compatible(saved.schema, s)) is not None
    ]
    if misfits:
        raise InputChangedError(
            "new input files don't fit the job's columns:\n  "
            + "\n  ".join(misfits)
            + "\nPut data with other columns in a job of its own (a new --output)"
        )
    sources = ordered_sources(found, records)
    plan, computed = identity(saved.schema)
    fingerprint = copy.deepcopy(computed)
    deferred = None
    saved_identity = saved.fingerprint.get("model", {}).get("identity", {})
    if "hub_id" in fingerprint["model"]["identity"] and "content" in saved_identity:
        # the hub model is not on this machine now: compare it by content once it is loaded
        deferred = saved_identity
        fingerprint["model"]["identity"] = saved_identity
    changes = _changes(spec, saved.fingerprint, fingerprint, plan.kind)
    if changes:
        raise JobMismatchError(
            f"--output {out_dir} holds a different job; changed: {'; '.join(changes)}. "
            "Use the original options to resume, or a new --output folder"
        )
    shard = replace(shard, chunk_rows=saved.chunk_rows or shard.chunk_rows)
    saved.inputs = records
    if taken:
        saved.input_paths = input_paths(spec)
    return Prepared(
        spec, out_dir, state, sources, saved, True, plan, shard, taken, deferred, found, computed, redo=redo
    )
