"""The columns a job's result rows carry: the input's, the task's result columns, then the feature columns
the job's options call for; and the run's one part writer, which writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchjob.io.writers import EXTRA_FIELDS, PartWriter
from batchjob.job.tasks import result_fields, task_extra

if TYPE_CHECKING:
    from batchjob.job.prepare import Prepared
    from batchjob.job.reasoning import ReasoningTags
    from batchjob.job.seam import JobEngine
    from batchjob.job.shard import Shard


def part_writer(prep: Prepared, engine: JobEngine, tags: ReasoningTags | None) -> PartWriter:
    """The run's one part writer: the input's columns, the task's result columns, then the feature columns
    the job's options (and with ``tags``, the model's thinking) call for."""
    spec = prep.spec
    if spec.engine.task == "generate":
        params = spec.sampling_params(prep.info.job_seed)
        extra = extra_fields(params, every=spec.per_row_params, reasoning=tags is not None)
        if spec.lora_paths:
            extra += (EXTRA_FIELDS["adapter"],)
    else:
        extra = task_extra(spec)
    return PartWriter(
        prep.out_dir, prep.info.schema, part_prefix(prep.shard), extra, result_fields(spec, engine)
    )


def extra_fields(params: Any, every: bool = False, reasoning: bool = False) -> tuple[Any, ...]:
    """The feature columns a job's results carry, after the result columns (``every``: all of them, for
    jobs whose rows choose their own parameters; ``reasoning``: a model that thinks in tags)."""
    names = ["reasoning"] if reasoning else []
    if every:
        return tuple(EXTRA_FIELDS[n] for n in names) + tuple(
            f for n, f in EXTRA_FIELDS.items() if n not in ("reasoning", "adapter")
        )
    if params.n > 1:
        names.append("sample_index")
    if params.choices is not None:
        names += ["choice_logprobs", "choice_probs"]
    if params.logprobs is not None:
        names.append("logprobs")
    return tuple(EXTRA_FIELDS[n] for n in names)


def part_prefix(shard: Shard) -> str:
    """Part file names of one worker: ``part-000012.parquet``, or ``part-00003-of-00008-000012.parquet``."""
    return "part-" if shard.single else f"part-{shard.index:05d}-of-{shard.count:05d}-"
