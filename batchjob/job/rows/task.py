"""The task row (``--task embed|classify|score``): one prefill-only request, whose output is the row's one
result row of the task's columns (``job/tasks.py``). It saves nothing in flight: a resume computes it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchjob.job.rows.base import Ask, RowWork, request_error
from batchjob.job.tasks import task_columns

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput


def task_result(
    task: str, k: int, out: RequestOutput, error: str | None, adapter: str | None
) -> dict[str, Any]:
    """A prefill-only request's result row (``k``: which of the row's inputs; ``error``: the request's;
    ``adapter``: the LoRA adapter it ran under)."""
    result = {"finish_reason": out.finish_reason, "num_generated_tokens": 0, "error": error}
    result |= {"sample_index": k, "adapter": adapter}
    return result | (task_columns(task, out) if error is None else {})


@dataclass(eq=False, kw_only=True)
class TaskRow(RowWork):
    """One prefill-only request; with --task score, of the scored text after the prompt."""

    kind = "task"
    task: str  # embed | classify | score
    continuation: list[int] | None = None  # --score-column: the scored text's ids
    token_logprobs: bool = False  # --task score --logprobs: each scored token's log-prob too

    def asks(self) -> list[Ask]:
        if self.task != "score":
            return [Ask(self.row_id, self.prompt_ids)]
        score = Ask(
            self.row_id,
            self.prompt_ids,
            continuation_ids=self.continuation,
            token_logprobs=self.token_logprobs,
        )
        return [score]

    def result(self, k: int, out: RequestOutput) -> dict[str, Any]:
        error = request_error(out)  # the engine's words (a text beyond the model's limit): whose row it is
        where = None if error is None else f"{self.row.place}: {error}"
        return task_result(self.task, k, out, where, self.adapter)
