"""The pool of KV blocks: a free list and reference counts. Pure Python; it never touches a tensor.

A block holds ``block_size`` consecutive tokens of one sequence. A request owns the blocks listed in its
``block_ids``, in order: token ``p`` of the request lives in slot ``block_ids[p // block_size] * block_size +
p % block_size`` of the flat cache.
"""

from __future__ import annotations

from collections import deque

from batchjob.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, req: Request, num_tokens: int) -> int:
        """Blocks ``req`` still needs to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` enough blocks for ``num_tokens`` tokens; False (and nothing taken) if too few are free."""
        missing = self.num_missing(req, num_tokens)
        if missing > len(self._free):
            return False
        for _ in range(missing):
            block = self._free.popleft()
            assert self.ref_counts[block] == 0, f"free block {block} has ref count {self.ref_counts[block]}"
            self.ref_counts[block] = 1
            req.block_ids.append(block)
        return True

    def free(self, req: Request) -> None:
        """Release every block of ``req``; blocks whose count drops to zero return to the free list."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed more often than taken"
            if self.ref_counts[block] == 0:
                self._free.append(block)
        req.block_ids = []
