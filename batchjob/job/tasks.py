"""The job layer's side of the prefill-only tasks (``--task embed|classify|score``, ``engine/tasks.py``):
a task job's result columns for its model, and a finished request's values for them.

What a task row asks the engine is ``rows/task.py``'s (``rows/embeddings.py``: an OpenAI embeddings line's
inputs); the rest of a task job is every job's (``loop.py``): ids, parts, checkpoints (a prefill-only request
saves nothing in flight: a resume computes it again), shards, status, export.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchjob.engine.tasks.state import HEADS, TASK_CHUNK, head_kind
from batchjob.errors import ConfigError
from batchjob.io.writers import EXTRA_FIELDS
from batchjob.job.kernels import kernels_entry
from batchjob.job.seam import JobEngine
from batchjob.job.spec import JobSpec


def result_fields(spec: JobSpec, engine: JobEngine) -> list[Any]:
    """The result columns of the job's task for this engine's model (``writers.task_fields``)."""
    from batchjob.io.writers import task_fields

    width, num_labels, head = None, 1, "single"
    if spec.engine.task == "embed":
        pooling = engine.tasks.pooling if engine.tasks is not None else None
        width = (pooling and pooling.dimensions) or engine.model.config.get_text_config().hidden_size
    elif spec.engine.task == "classify":
        labels = engine.model.config.num_labels
        assert labels is not None  # a sequence-classification head has its labels
        num_labels = int(labels)
        head = head_kind(engine.model.config)
    return task_fields(spec.engine.task, width, num_labels, spec.logprobs is not None, head)


def embed_input(spec: JobSpec, plan: Any, engine: JobEngine) -> Callable[[str], list[int]] | None:
    """How an embed job makes a text's token ids: the engine's ``tokenize``, which follows the model's
    sentence-transformers files (a prompt, the chat template) as ``encode`` does; None for the other tasks.
    A job that renders its own chat (--chat, --messages-column) is refused where those files make the input
    themselves, so the two never stack."""
    pooling = engine.tasks.pooling if engine.tasks is not None else None
    if spec.engine.task != "embed" or pooling is None:
        return None
    if (pooling.prompt or pooling.chat) and (plan.chat or plan.kind == "messages"):
        what = "renders each text through the chat template" if pooling.chat else "puts a prompt before it"
        flag = "--messages-column" if plan.kind == "messages" else "--chat"
        raise ConfigError(
            f"{flag}: the model folder's sentence-transformers files make each text the model's input "
            f"themselves (it {what}, as encode does: sentence_bert_config.json, "
            "config_sentence_transformers.json); give the text alone (--prompt-column or --template, "
            "without --chat)"
        )
    return engine.tokenize


def task_fingerprint(spec: JobSpec) -> dict[str, Any]:
    """The task and its options (empty for generation, so a generation job keeps its identity)."""
    if spec.engine.task == "generate":
        return {}
    out: dict[str, Any] = {"task": spec.engine.task, "truncate": spec.engine.truncate}
    if spec.engine.task == "embed":
        out |= {
            "pooling": spec.engine.pooling,
            "normalize": spec.engine.normalize,
            "dimensions": spec.engine.dimensions,
        }
        if spec.engine.prompt_name is not None:  # named only when given, so a job keeps its identity
            out["prompt_name"] = spec.engine.prompt_name
    if spec.engine.task == "score":
        out |= {"score_column": spec.score_column, "token_logprobs": spec.logprobs is not None}
    if spec.engine.max_model_len is not None:  # it cuts (with --truncate) or fails long texts
        out["max_model_len"] = spec.engine.max_model_len
    # Where a row's chunks start (the engine's chunk grid): resuming with other chunks could change the
    # last bits of the floats written. Named only when not the defaults', so a job keeps its identity.
    chunk = min(TASK_CHUNK, spec.engine.max_num_batched_tokens or TASK_CHUNK)
    if chunk != TASK_CHUNK or spec.engine.block_size is not None:
        out["chunks"] = {"tokens": chunk, "block_size": spec.engine.block_size}
    # So could other kernels (kernels.py; the entry is there, if empty, so that a job recorded before it is
    # told apart)
    out["kernels"] = kernels_entry(spec.engine)
    return out


def head_fingerprint(spec: JobSpec) -> dict[str, Any]:
    """classify: how the head's outputs are read, where not as one label of all (so such a job keeps its
    identity): a job an earlier batchjob started on a multi-label head, writing a softmax, is not resumed
    into this one's sigmoid columns. embed: the folder's settings batchjob reads since 2026-12-07, where it
    has them (``_recipe_entry``)."""
    if spec.engine.task == "embed":
        return _recipe_entry(spec)
    if spec.engine.task != "classify":
        return {}
    from batchjob.job.model_identity import local_folder
    from batchjob.models import resolve_model

    folder = local_folder(resolve_model(spec.model))
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if folder else {}
    except (OSError, ValueError, RecursionError):
        config = {}  # the model's load says what is wrong with it
    problem = config.get("problem_type") if isinstance(config, dict) else None
    kind = HEADS.get(problem) if isinstance(problem, str) else None
    return {"head": kind} if kind in ("multi", "regression") else {}


def task_extra(spec: JobSpec) -> tuple[Any, ...]:
    """The feature columns of a prefill-only task's job: ``sample_index`` (which of an embeddings request's
    inputs) with --format openai, and ``adapter`` with --lora."""
    extra = (EXTRA_FIELDS["sample_index"],) if spec.format == "openai" else ()
    return extra + ((EXTRA_FIELDS["adapter"],) if spec.lora_paths else ())


def task_columns(task: str, out: Any) -> dict[str, Any]:
    """A prefill-only request's result columns (``writers.task_fields``) from its ``RequestOutput``."""
    if task == "embed":
        return {"embedding": out.embedding.astype("float32").tolist()}
    if task == "classify":
        columns: dict[str, Any] = {"scores": out.logits.astype("float32").tolist()}
        if out.probs is not None:
            columns["probs"] = out.probs.astype("float32").tolist()
        if out.labels is not None:  # a multi-label head: each label above the threshold, in label order
            columns["labels"] = list(out.labels)
        elif out.probs is not None:
            columns["label"] = out.label
        if out.score is not None:
            columns["score"] = float(out.score)
        return columns
    return {
        "logprob": float(out.logprob),
        "num_scored_tokens": int(out.num_scored_tokens),
        "perplexity": out.perplexity,
        "token_logprobs": None if out.token_logprobs is None else [float(x) for x in out.token_logprobs],
    }


def _recipe_entry(spec: JobSpec) -> dict[str, Any]:
    """An embedding folder's truncate_dim and tokenizer arguments (sentence-transformers files), which
    batchjob once ignored: a job an earlier batchjob started on such a folder wrote vectors of another width
    or texts cut elsewhere, and is not resumed into these (one without them keeps its identity)."""
    from batchjob.engine.tasks.st_folder import st_file  # (reads JSON files)
    from batchjob.models import resolve_model

    model = resolve_model(spec.model)
    config = st_file(model, "config_sentence_transformers.json", unknown_is_absent=True) or {}
    bert = st_file(model, "sentence_bert_config.json", unknown_is_absent=True) or {}
    read = {"truncate_dim": config.get("truncate_dim") if isinstance(config, dict) else None}
    if isinstance(bert, dict):
        read |= {k: bert.get(k) for k in ("processor_kwargs", "tokenizer_args")}
    given = {k: v for k, v in read.items() if v}
    return {"folder": given} if given else {}
