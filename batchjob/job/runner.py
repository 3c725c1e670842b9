"""Running a job: prepare it (``prepare.py``), load and check the engine, settle the saved state, then the
loop (``loop.py``) under the job's own signal handling; checkpoints and parts are ``checkpoint.py``'s.

``run_job`` is the entry point (the CLI's ``run``, each ``--devices`` or Ray worker); ``load_engine`` and
``check_engine`` (``validate``) load or check the engine a spec asks for, ``prompt_builder`` builds its prompts.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from batchjob import faults, signals
from batchjob.errors import BatchjobError, ConfigError, StateError
from batchjob.io.atomic import write_json
from batchjob.io.writers import EXTRA_FIELDS, PartWriter, output_names
from batchjob.job import model_identity
from batchjob.job.chat_kwargs import check_job_kwargs
from batchjob.job.checks import check_tokenizer_texts
from batchjob.job.given_engine import check_given_engine, take_model
from batchjob.job.loop import JobLoop, JobResult, part_writer, think_tags
from batchjob.job.lora import check_adapters, held_identity
from batchjob.job.manifest import Manifest
from batchjob.job.owned import check_foreign
from batchjob.job.prepare import Prepared, prepare, reload
from batchjob.job.prompts import PromptBuilder
from batchjob.job.rows.images import ImagePrompts, check_image_model, check_job_render, image_prompts
from batchjob.job.seam import JobEngine
from batchjob.job.shard import Shard
from batchjob.job.spec import JobSpec
from batchjob.job.state import JobMismatchError
from batchjob.job.tasks import embed_input
from batchjob.job.verify import check_schema, needs_repair, repair_outputs, restamp
from batchjob.models import generation_config_file

_DEFAULT_MAX_NEW_TOKENS = JobSpec.__dataclass_fields__["max_new_tokens"].default  # 128, said as the default


def load_engine(spec: JobSpec) -> JobEngine:
    from batchjob.engine import Engine

    trust, lora = spec.trust_remote_code, spec.lora_paths or None
    return Engine.from_pretrained(spec.model, trust_remote_code=trust, options=spec.engine, lora=lora)


def check_engine(spec: JobSpec) -> str:
    """What ``load_engine`` refuses, checked from the model's config without its weights: code the model
    ships (without ``trust_remote_code``), a model family or feature the attention would get wrong, a
    generation_config.json asking for a logits processor not built (``penalties.py``), ``max_model_len``
    beyond the model's context, a KV pool that can't hold one request of the context.
    Returns a line saying what the engine will get."""
    from batchjob.engine.config import EngineConfig
    from batchjob.engine.penalties import config_penalty
    from batchjob.engine.plan import plan_kv, plan_model
    from batchjob.models import generation_config_file, load_config, load_generation_config

    model_config, resolved = load_config(spec.model, spec.trust_remote_code)
    check_image_model(spec, model_config)
    config = EngineConfig(**spec.engine.as_keywords())
    plan = plan_model(model_config, config)  # the engine's refusals, from plan.py
    max_len = plan.max_model_len
    check_adapters(spec.lora_paths, config, resolved, model_config, plan.encoder, spec.trust_remote_code)
    if config.task == "generate":  # the processors its generation_config.json asks for, as the load refuses
        config_penalty(load_generation_config(resolved), config.task, generation_config_file(resolved))
    if config.task == "embed":  # what the folder's sentence-transformers files ask that batchjob refuses
        from batchjob.engine.tasks.st_folder import resolve_pooling  # (light: reads JSON files)

        width = model_config.get_text_config().hidden_size
        dtype = str(config.dtype).removeprefix("torch.")  # its name, as the folder's files give one
        resolve_pooling(
            resolved, config.pooling, config.normalize, config.dimensions, width, config.prompt_name, dtype
        )
    if config.task == "classify":  # a CrossEncoder folder reads pairs, through its activation
        from batchjob.engine.tasks.st_folder import refuse_cross_encoder  # (light: reads JSON files)

        refuse_cross_encoder(resolved, model_config)
    tp = config.tensor_parallel_size  # each rank caches its own share of the KV heads, as the engine does
    kv = plan_kv(model_config, config, max_len, tp)
    blocks = kv.num_blocks
    if blocks is None:
        return (
            f"context {max_len} tokens; the KV pool is sized at load by profiling {config.device} memory, "
            "and checked then to hold one request of that context"
        )
    kv.check_pool(config, blocks)
    per_rank = f" on each of {tp} ranks" if tp > 1 else ""
    return (
        f"context {max_len} tokens; KV pool {blocks} blocks x {config.block_size} tokens = "
        f"{blocks * config.block_size} tokens{per_rank} (sized by {config.kv_pool_source})"
    )


def _already_complete(prep: Prepared) -> JobResult | None:
    """A share complete for these inputs, every row listed in its manifest and no part to redo: its result;
    else None (the run redoes what is missing)."""
    if not prep.info.complete:
        return None
    manifest = Manifest(prep.state.manifest_file, readonly=True)  # the lock is not held yet
    total = prep.shard.share_of(prep.info.row_counts)
    listed = total is not None and manifest.rows >= total  # else the manifest lost lines: redo those rows
    if not listed or needs_repair(prep.out_dir, manifest, prep.spec.retry_errors):
        return None
    _restamp(prep)
    return JobResult("already complete", prep.out_dir, manifest.rows, total, manifest.errors)


def run_job(spec: JobSpec, engine: JobEngine | None = None, shard: Shard | None = None) -> JobResult:
    """Run (or resume) a job to completion. Returns its result; raises BatchjobError for what the user can fix.

    SIGTERM and SIGINT stop it cleanly: finished rows are committed, in-flight requests checkpointed, and the
    result's status is ``"interrupted"`` (the CLI exits 75). ``engine``: an already loaded one to reuse, the
    one the spec asks for (``given_engine.py``). ``shard``: run only this worker's share of a job split over
    several workers sharing ``spec.output``. The job is prepared (inputs discovered, the model identified,
    prompts planned) once per start.
    """
    prep = _prepare(spec, engine, shard)
    if (done := _already_complete(prep)) is not None:
        return done
    _say_dtype_hint(prep)
    _say_inputs(prep)
    prep.out_dir.mkdir(parents=True, exist_ok=True)
    prep.state.create()
    state = prep.state
    state.lock()
    loaded = engine is None  # the job's own engine is closed with it (a tensor-parallel one's ranks stop)
    try:
        check_image_model(spec, engine.model.config if engine is not None else None)  # before the weights
        if engine is None:
            faults.point("before_model_load")
            with signals.phase("loading the model"):  # what a start-up signal's message says
                faults.point("during_model_load")
                engine = load_engine(spec)
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        _check_tokenizer(prep, engine, has_template)  # before work, as validate
        _settle(prep, engine)
        _say_generation_config(prep, engine)
        if not prep.resumed and not state.create_job(prep.info):
            # another worker of the job created it first: take its seed and chunk size, if it is the same job
            prep = reload(prep)
            _settle(prep, engine)
        manifest = Manifest(prep.state.manifest_file)
        tags = think_tags(spec, engine.tokenizer)  # the model's thinking: a reasoning column, two-phase rows
        writer = part_writer(prep, engine, tags)  # the run's one writer: repairs here, then the loop's parts
        _say_renamed(writer)
        check_schema(prep.out_dir, manifest, tuple(EXTRA_FIELDS.values()))  # one job, one schema
        # verify.py. Before --append's records are saved: a crash between leaves the old records, and the
        # next start finds the same rows to redo (a torn last line finished since, in ``prep.redo``).
        reason = "its input line was not finished when it was read, and is now"
        repair_outputs(prep.state, prep.info, manifest, writer, spec.retry_errors, set(prep.redo), reason)
        if prep.taken:
            prep = _take_in(prep)
        plan = prep.plan.for_tokenizer(spec, has_template)  # the plan assumed a chat template until now
        if not prep.shard.single:
            prep.state.save_job(prep.info)  # a progress.json: status sees this worker has started
        writer.remove_orphans(manifest.names)
        builder = prompt_builder(spec, plan, engine)
        loop = JobLoop(prep, engine, builder, writer, tags, _image_prompts(prep, plan, engine))
        # While it runs, SIGTERM/SIGINT ask the loop to checkpoint and stop. Before, the command's own
        # handlers apply (signals.py): during start-up a signal exits 75 at once, with nothing to save.
        with signals.handling(loop.on_signal):
            faults.point("loop_started")
            return loop.run()
    finally:
        if loaded and engine is not None:
            engine.close()
        state.unlock()


def _prepare(spec: JobSpec, engine: JobEngine | None, shard: Shard | None) -> Prepared:
    """The job prepared (``prepare.py``); with an engine given, for its model where the spec names none, and
    that engine checked to be the spec's (``given_engine.py``) before anything is written: the job records
    the spec's identity, whatever the engine computes."""
    prep = prepare(take_model(spec, engine), shard=shard)
    check_given_engine(prep, engine)
    check_foreign(prep.out_dir)  # before work, and before saying "already complete"
    return prep


def _check_tokenizer(prep: Prepared, engine: JobEngine, has_template: bool) -> None:
    """What the model's tokenizer refuses of the job, as ``validate`` checks it: stop strings and choices
    it can't tell, chat-template kwargs with no chat render or that its template never reads, a template that
    rejects or drops --system or a plain prompt."""
    spec = prep.spec
    check_tokenizer_texts(spec.stop, spec.choices, engine.tokenizer)
    plan = prep.plan.for_tokenizer(spec, has_template)  # (kwargs without a chat render: said first)
    check_job_kwargs(spec, prep.plan, engine.tokenizer, engine.model.config, prep.resumed)
    # a template that rejects or drops what every row gives it (a VLM's job: its processor's)
    check_job_render(spec, plan, engine.tokenizer, engine.model.config)


def _image_prompts(prep: Prepared, plan: Any, engine: JobEngine) -> ImagePrompts | None:
    """Image rows (--image-column, or OpenAI image parts on a vision-language model): the processor builds
    them; the digests of the files they name are recorded (the image parts' now: the model is known)."""
    prompts = image_prompts(prep.spec, plan, engine, prep)
    if prompts is not None and prep.images is None:
        from batchjob.job.prepare import record_images
        from batchjob.job.rows.image_parts import refs_of

        recorded = record_images(prep, refs_of(prep.spec, plan))
        prompts.recorded, prompts.remote = recorded.images or {}, recorded.remote
    if prompts is not None:  # (shared by a job's workers: one writes it at a time)
        with prep.state.job_lock() if not prep.shard.single else contextlib.nullcontext():
            write_json(prep.state.images_file, {"images": prompts.recorded})
    return prompts


def _say_renamed(writer: PartWriter) -> None:
    """A line for each input column written under another name (``writers.output_names``): a reader who
    looks for the input's ``error`` column finds it, and does not take the result's for it."""
    names = output_names(writer.input_schema.names, writer.extra, writer.result)
    for column, name in names.items():
        if name != column:
            print(
                f"batchjob: input column {column!r} is written as {name!r} (it clashes with a result column)",
                file=sys.stderr,
            )


def _say_inputs(prep: Prepared) -> None:
    """A line where the --input folders or globs left out files of a format batchjob does not read (a folder
    of .csv files beside the .jsonl ones would otherwise go unprocessed without a word), and one where they
    are partitioned as key=value folders, which are no columns here (as they are in Spark or Ray Data)."""
    other = [s for s in prep.skipped if s.reason.startswith("not .parquet")]
    if other:
        print(
            f"batchjob: the inputs left out {len(other)} file(s) of another format, e.g. {other[0].path} "
            "(`batchjob validate` lists them)",
            file=sys.stderr,
        )
    hive = next((s for s in prep.sources if any("=" in part for part in s.name.split("/")[:-1])), None)
    if hive is not None:
        print(
            f"batchjob: {hive.name}: a folder named key=value (a hive partition) is no column here; a row's "
            "file is in its derived id, and a value the prompt or the output needs must be a column of the files",
            file=sys.stderr,
        )


def _say_dtype_hint(prep: Prepared) -> None:
    """One line where a new generation job left the dtype to the engine and bf16 would be much faster here (a
    resume keeps the job's dtype: no hint to change it; the figures it quotes are generation's)."""
    from batchjob.engine.config import resolve_device, resolve_dtype
    from batchjob.engine.cpu.bf16 import dtype_hint

    if prep.resumed or prep.spec.engine.task != "generate":
        return
    given = prep.spec.engine.dtype
    try:
        device = resolve_device(prep.spec.engine.device)
        line = dtype_hint(device, resolve_dtype(given, device), given not in (None, "auto"))
    except BatchjobError:
        return  # a bad device: the engine's load says so
    if line is not None:
        print(f"batchjob: {line}", file=sys.stderr)


def _say_generation_config(prep: Prepared, engine: JobEngine) -> None:
    """A new generation job's lines on what the model's generation config asks of decoding: its repetition
    penalty applies, as generate applies it; its sampling settings and length do not (a job's are its own),
    each said where the folder sets one the job does not take, with what the job takes instead."""
    spec, config = prep.spec, getattr(engine.model, "generation_config", None)
    if prep.resumed or spec.engine.task != "generate" or config is None:
        return
    where = f"the model's {generation_config_file(engine.model_id) or 'generation config'}"
    penalty = getattr(config, "repetition_penalty", None)
    if spec.repetition_penalty is None and penalty not in (None, 1.0):
        say = f"{where} sets repetition_penalty {penalty}: it applies to every row"
        print(
            f"batchjob: {say}, as transformers' generate applies it (--repetition-penalty 1: none)",
            file=sys.stderr,
        )
    for line in (_sampling_not_taken(spec, config), _length_not_taken(spec, config)):
        if line is not None:
            print(f"batchjob: {where} {line}", file=sys.stderr)


def _sampling_not_taken(spec: JobSpec, config: Any) -> str | None:
    """What a job says of the sampling settings the model's generation config sets and the job does not take
    (None: nothing to say). A greedy job takes none; a sampling one (or one whose rows may sample) its own."""
    keys = ("temperature", "top_p", "top_k", "min_p")
    folder = {k: getattr(config, k, None) for k in keys}
    if spec.effective_temperature == 0 and not spec.per_row_params:  # greedy: only a sampling config differs
        if not getattr(config, "do_sample", False) or spec.temperature is not None:
            return None  # generate decodes greedily too, or the job asked for greedy itself
        named = ", ".join(f"{k} {_num(v)}" for k, v in folder.items() if v is not None)
        greedy = "this job decodes greedily, the default for labels (a --temperature above 0 samples)"
        return f"samples ({named}); {greedy}"
    job = dict(zip(keys, (spec.effective_temperature, spec.top_p, spec.top_k, spec.min_p), strict=True))
    differ = [k for k in keys if folder[k] is not None and folder[k] != job[k]]
    if not differ:
        return None
    off = {"top_k": 0, "min_p": 0}  # the job's values that keep every token
    taken = ", ".join(f"{k} {_num(job[k])}" + (" (off)" if off.get(k) == job[k] else "") for k in differ)
    verb = "this job samples at" if spec.effective_temperature > 0 else "this job's rows take"
    rows = " where a row's parameters leave them out" if spec.per_row_params else ""
    flags = "/".join(f"--{k.replace('_', '-')}" for k in differ)
    named = ", ".join(f"{k} {_num(folder[k])}" for k in differ)
    return f"sets {named}, which this job does not take: {verb} {taken}{rows}; give {flags} to use them"


def _length_not_taken(spec: JobSpec, config: Any) -> str | None:
    """What a job says of the model's max_new_tokens (else max_length: prompt and answer), which it does not
    take: its own --max-new-tokens bounds every row (None: nothing to say)."""
    wanted, length = getattr(config, "max_new_tokens", None), getattr(config, "max_length", None)
    if wanted is not None:
        if wanted == spec.max_new_tokens:
            return None
        named, give = f"max_new_tokens {wanted}", f"give --max-new-tokens {wanted} to use it"
    elif length is not None:
        named, give = f"max_length {length} (prompt and answer)", "give --max-new-tokens to change it"
    else:
        return None
    default = ", its default" if spec.max_new_tokens == _DEFAULT_MAX_NEW_TOKENS else ""
    rows = " where a row's parameters leave it out" if spec.per_row_params else ""
    return (
        f"sets {named}, which this job does not take: it generates at most {spec.max_new_tokens} tokens "
        f"a row (--max-new-tokens{default}){rows}; {give}"
    )


def _num(value: Any) -> str:
    """A setting's value as a line shows it: 1 and 0.9 for floats (not 1.0), others as they are."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def prompt_builder(spec: JobSpec, plan: Any, engine: JobEngine) -> PromptBuilder:
    """The prompt builder for the job's task: generation checks a prompt against the context; a prefill-only
    task leaves the length to the engine (an error, or cut with --truncate as ``Engine.tokenize`` cuts)."""
    if spec.engine.task == "generate":
        return PromptBuilder(plan, engine.tokenizer, engine.max_model_len, spec.template_kwargs)
    cut = engine.prefill_limit if spec.engine.truncate else None
    tokenize = embed_input(spec, plan, engine)
    return PromptBuilder(
        plan, engine.tokenizer, None, spec.template_kwargs, truncate_to=cut, tokenize=tokenize
    )


def _restamp(prep: Prepared) -> None:
    """A complete job whose parts were read whole to be trusted (a copied folder): record their new stamps
    (``verify.restamp``), under the lock, unless another run holds it."""
    try:
        prep.state.lock()
    except StateError:
        return
    try:
        restamp(prep.out_dir, Manifest(prep.state.manifest_file))
    finally:
        prep.state.unlock()


def _settle(prep: Prepared, engine: JobEngine) -> None:
    """The model and the adapters the job records, as the engine loaded them."""
    _settle_model(prep, engine)
    _settle_adapters(prep, engine)


def _settle_model(prep: Prepared, engine: JobEngine) -> None:
    """A model named by a hub id that was not on this machine before loading: identify it now, by content."""
    model = prep.info.fingerprint["model"]
    hub_id = model["identity"].get("hub_id") or (prep.model_check and engine.model_id)
    if not hub_id:
        return
    now = model_identity.identity(model_identity.model_files(engine.model_id or hub_id), hub_id)
    if prep.model_check is not None:
        change = model_identity.changes(prep.model_check, now)
        if change:
            raise JobMismatchError(
                f"--output {prep.out_dir} holds a different job; changed: {change}. "
                "Use the original model to resume, or a new --output folder"
            )
    else:
        model["identity"] = now


def _settle_adapters(prep: Prepared, engine: JobEngine) -> None:
    """The job records its adapters as the engine read them (``held_identity``). ``prepare`` identified each
    folder before the load: one rewritten between (a training run saving its next checkpoint) would have the
    job record files it did not compute with, and is refused. A hub id not on this machine then is recorded
    by the files the engine fetched and read (a resumed job keeps the id it recorded)."""
    recorded = prep.info.fingerprint.get("lora")
    if not recorded:
        return
    have = held_identity(engine)
    folders = {a.name: a.path for a in engine.lora.adapters} if engine.lora is not None else {}
    for name, saved in recorded.items():
        if str(saved).startswith("hub:"):
            if not prep.resumed and name in have:
                recorded[name] = have[name]
            continue
        if have.get(name) != saved:
            raise ConfigError(
                f"LoRA adapter {name!r}: its folder {folders.get(name)} changed while the job started (the "
                "files the engine read are not those the job checked moments before, as when a training run "
                "saves into it); run again once nothing writes to it, or give a copy of the checkpoint in a "
                "folder of its own"
            )


def _take_in(prep: Prepared) -> Prepared:
    """--append: save the records of grown and new input files before any of their rows is read."""
    state = prep.state
    if not prep.shard.single:
        with state.job_lock():  # workers appending at once: each checks against what the others saved
            prep = reload(prep)
            if prep.taken:
                state.save_inputs(prep.info)
    else:
        state.save_job(prep.info)
    for line in prep.taken:
        print(f"batchjob: --append: {line}", file=sys.stderr)
    return prep
