"""The prefill-only tasks' chunk policies (the scheduler's ``ChunkPolicy``): an encoder's row runs whole,
a causal task's rows on a fixed grid.

A chunk grid makes a row's chunks a function of its tokens alone: the part the prefix cache could hold
(``BlockManager.reusable``, its ``cut``) and the rest are each cut in chunks of ``grid`` tokens from their
start, and a chunk is computed whole in one step or waits for a step with the budget for it. A row takes
its reusable part from the cache only whole, computed by rows of the same cut (so in the same chunks). The
floats a task writes then never depend on which rows shared its steps, or on whether a restart found a
prefix cached.
"""

from __future__ import annotations

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.request import Request
from batchjob.engine.scheduler import ChunkPolicy


class WholeRows(ChunkPolicy):
    """An encoder's row (attended both ways): it runs whole in one step or waits."""

    def chunk(self, req: Request, computed: int, budget: int, block_manager: BlockManager) -> int:
        left = req.num_tokens - computed
        return left if left <= budget else 0


class ChunkGrid(ChunkPolicy):
    """Chunks of ``grid`` tokens from the start of the part a row is in (cached or not), to its end."""

    whole_prefix = True

    def __init__(self, grid: int) -> None:
        self.grid = grid  # at most the token budget (or no chunk would ever fit)

    def fits(self, max_num_batched_tokens: int) -> bool:
        return 0 < self.grid <= max_num_batched_tokens

    def chunk(self, req: Request, computed: int, budget: int, block_manager: BlockManager) -> int:
        cut = block_manager.reusable(req)
        start, end = (0, cut) if computed < cut else (cut, req.num_tokens)
        whole = min(start + ((computed - start) // self.grid + 1) * self.grid, end) - computed
        return whole if whole <= budget else 0
