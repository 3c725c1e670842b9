"""The OpenAI embeddings row (``--task embed --format openai``): a ``/v1/embeddings`` request line whose
``body.input`` holds one text or several, a prefill-only request each; the row's result rows, one per input
by ``sample_index``, are written together once every input is done. Nothing is saved in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchjob.job.rows.base import Ask, RowWork, request_error
from batchjob.job.rows.task import task_result

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput


@dataclass(eq=False, kw_only=True)
class EmbeddingInputs(RowWork):
    """A request line's inputs (``prompt_ids`` is the first's), one engine request each."""

    kind = "embeddings"
    task: str  # the job's --task (whose columns each input's result has)
    inputs: list[list[int]]  # each input's token ids

    @property
    def expected(self) -> int:
        return len(self.inputs)

    def asks(self) -> list[Ask]:
        """A request per input; its id only needs to be unique among the engine's (no sampler reads it)."""
        return [Ask(f"{self.row_id}\x1finput{k}", ids, part=k) for k, ids in enumerate(self.inputs)]

    def result(self, k: int, out: RequestOutput) -> dict[str, Any]:
        error = request_error(out)
        where = None if error is None else f"body.input[{k}]: {error}"
        return task_result(self.task, k, out, where, self.adapter)
