"""A row's request: its sampling parameters (the job's, and what the row brings) and its prompt ids, or the
reason it has none, naming the line and the field. The estimate (``estimate.py``) builds rows the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchjob.job.requests import params_from_column, parse_request

if TYPE_CHECKING:
    from batchjob.io.readers import Row
    from batchjob.job.prompts import PromptBuilder
    from batchjob.job.spec import JobSpec
    from batchjob.sampling import SamplingParams


def row_request(
    spec: JobSpec, builder: PromptBuilder, base: SamplingParams, row: Row, model_names: set[str] | None = None
) -> tuple[SamplingParams | None, list[int] | None, str | None]:
    """A row's sampling parameters (``base`` and what the row brings) and prompt ids, or the reason it has
    none, naming the line and the field. ``model_names``: what ``body.model`` may say (--check-model-name).

    Whatever goes wrong with one row (a value the chat template or tokenizer chokes on, one nested too
    deeply for a parser, any exception of ours or a library's) is that row's error, never the job's stop."""
    assert row.values is not None
    try:
        return _row_request(spec, builder, base, row, model_names)
    except Exception as e:  # noqa: BLE001 - one row must not stop the job, whatever it raises
        where = f"{row.source} line {row.line}" if row.line is not None else f"{row.source} row {row.index}"
        what = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        return None, None, f"{where}: cannot build this row's request ({what})"[:2000]


def _row_request(
    spec: JobSpec, builder: PromptBuilder, base: SamplingParams, row: Row, model_names: set[str] | None
) -> tuple[SamplingParams | None, list[int] | None, str | None]:
    assert row.values is not None
    where = f"{row.source} line {row.line}: " if row.line is not None else ""
    params: SamplingParams | None = base
    if spec.format == "openai":
        request, params, error = parse_request(row.values, base, model_names)
        if request is None:
            return None, None, where + str(error)
        ids, error = builder.build_request(request)
        return params, ids, error
    if spec.params_column is not None:
        params, error = params_from_column(row.values.get(spec.params_column), spec.params_column, base)
        if params is None:
            return None, None, where + str(error)
    ids, error = builder.build(row.values)  # an empty or too long prompt: say whose row it is
    return params, ids, None if error is None else f"{row.place}: {error}"
