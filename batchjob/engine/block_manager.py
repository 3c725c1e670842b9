"""The pool of KV blocks: free list, reference counts and the prefix cache. Pure Python, no tensors.

A block holds ``block_size`` consecutive tokens of one sequence. A request owns the blocks listed in its
``block_ids``, in order: token ``p`` lives in slot ``block_ids[p // block_size] * block_size + p %
block_size`` of the flat cache.

Prefix caching: once a block is full and computed, it is registered under a chained digest of every token
up to its end (so equal digests mean equal prefixes), with its own tokens kept to check a hit. A later
request whose prompt starts with the same tokens takes those blocks (the ref count goes up) instead of
computing them. A released block keeps its contents and stays findable until it is reused: the free list is
least-recently-released first, so the blocks of a popular prefix survive longest.

With ``grow`` (the CPU's pool, whose pages the OS gives only when first written: platform.py), the pool grows
on demand up to its size: a released block is reused before a block never used is taken (one holding a
cached prefix only once the pool has twice the most blocks in use at once), so the memory the pool holds
follows the most blocks the job has had in use at once, not the budget.

A block also keeps the ``cut`` of the request that computed it (:meth:`BlockManager.reusable`): a request
that takes only whole reusable parts (``match_prefix(req, whole=True)``, a prefill-only task's rows)
takes blocks computed by a request with its own cut, whose chunks (scheduler.py's grid) were its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from batchjob.engine.request import Request


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """Digest of a full block given its parent's digest: it identifies the whole prefix."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, grow: bool = False
    ) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Blocks [0, grown) have been handed out at least once; the free ones among them are in _free
        # (least-recently-released first). Without ``grow`` the whole pool counts as grown from the start.
        self.grown = 0 if grow else num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.grown))
        self.peak_used = 0  # the most blocks in use at once
        self._cached: dict[bytes, int] = {}  # prefix digest -> block holding it
        # per block: (digest, its tokens, the cut of the request that computed it) while findable
        self._block_key: list[tuple[bytes, tuple[int, ...], int] | None] = [None] * num_blocks
        # Digests of full prompt blocks that running requests are computing right now: a request that
        # needs one of them waits for it rather than computing the same prefix a second time.
        self._in_flight: dict[bytes, Request] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self.grown

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, req: Request, num_tokens: int) -> int:
        """Blocks ``req`` still needs to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` enough blocks for ``num_tokens`` tokens; False (and nothing taken) if too few are free."""
        missing = self.num_missing(req, num_tokens)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            if self._grow_first():  # a block never used, rather than none or a cached prefix's
                self._free[self.grown] = None
                self._free.move_to_end(self.grown, last=False)
                self.grown += 1
            block, _ = self._free.popitem(last=False)
            assert self.ref_counts[block] == 0, f"free block {block} has ref count {self.ref_counts[block]}"
            key = self._block_key[block]
            if key is not None:  # evict its cached contents: the block is about to be overwritten
                del self._cached[key[0]]
                self._block_key[block] = None
            self.ref_counts[block] = 1
            req.block_ids.append(block)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return True

    def _grow_first(self) -> bool:
        """Whether to take a block never used before a released one: when none is released, or when the
        oldest released one holds a cached prefix and the pool holds fewer than twice the most blocks ever
        in use at once (so the prefix cache keeps as much again as the job uses)."""
        if self.grown == self.num_blocks:
            return False
        if not self._free:
            return True
        oldest = next(iter(self._free))
        return self._block_key[oldest] is not None and self.grown < 2 * max(1, self.peak_used)

    def free(self, req: Request) -> None:
        """Release every block of ``req``; blocks whose count drops to zero return to the free list.

        The tail is released first, so it is reused before the (more shareable) head of the prefix.
        """
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed more often than taken"
            if self.ref_counts[block] == 0:
                self._free[block] = None
        req.block_ids = []
        req.num_registered_blocks = 0
        for digest in req.block_digests:
            if self._in_flight.get(digest) is req:
                del self._in_flight[digest]

    # -- prefix cache ------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks stay free). Only while no request holds a block."""
        assert self.num_used_blocks == 0 and not self._in_flight, "reset_prefix_cache with blocks in use"
        self._cached.clear()
        self._block_key = [None] * self.num_blocks

    def _digests(self, req: Request, num_full: int) -> list[bytes]:
        """Chained digests of the first ``num_full`` full blocks of ``req`` (memoized on the request)."""
        bs, toks, digests = self.block_size, req.token_ids, req.block_digests
        # A LoRA adapter's prefixes chain from their own root (4 bytes: no length collides with b"" or a
        # 16-byte parent), so a prefix computed under one adapter never serves another.
        root = req.adapter.to_bytes(4, "little") if req.adapter else b""
        if req.long_rope:  # rotated with a longrope model's long set (rope.py): 1 or 5 bytes, its own roots
            root += b"L"
        while len(digests) < num_full:
            i = len(digests)
            parent = digests[-1] if digests else root
            if req.images is not None:  # a block holding image tokens is keyed by its images too
                parent += req.images.block_bytes(i * bs, (i + 1) * bs)
            digests.append(block_digest(parent, toks[i * bs : (i + 1) * bs]))
        return digests[:num_full]

    def reusable(self, req: Request) -> int:
        """The tokens of ``req`` that cached blocks could hold, its ``cut``: full blocks, leaving at least
        its last token to compute (so it still gets that token's logits), and for a prefill-only request
        (tasks.py) every position from its ``compute_from`` on (the rows its result is made of)."""
        last = req.num_tokens - 1 if req.task is None else min(req.num_tokens - 1, req.task.compute_from)
        return last // self.block_size * self.block_size

    def match_prefix(self, req: Request, whole: bool = False) -> int:
        """Take the cached blocks that hold a prefix of ``req`` (a new request, no blocks yet), up to its
        :meth:`reusable` part; with ``whole``, that part whole, computed by requests of the same cut, or
        nothing. Returns the number of tokens they hold."""
        assert not req.block_ids
        if not self.enable_prefix_caching:
            return 0
        bs, cut = self.block_size, self.reusable(req)
        found = []
        for i, digest in enumerate(self._digests(req, cut // bs)):
            block = self._cached.get(digest)
            key = None if block is None else self._block_key[block]
            if (
                key is None
                or key[1] != tuple(req.token_ids[i * bs : (i + 1) * bs])
                or (whole and key[2] != cut)
            ):
                break
            found.append(block)
        if whole and len(found) * bs < cut:
            return 0
        for block in found:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            req.block_ids.append(block)
        return len(req.block_ids) * bs

    def holds(self, req: Request, position: int) -> bool:
        """Whether the prefix cache holds, or another request is computing, the block of ``req``'s prompt with
        ``position`` (and so, the digests being chained, every block before it) within its reusable part: a
        request not admitted yet would take that prefix instead of computing it. A hint (the tokens are not
        compared, as :meth:`match_prefix` does): the vision hook reads it to leave such images unencoded."""
        bs = self.block_size
        index = position // bs
        if not self.enable_prefix_caching or (index + 1) * bs > self.reusable(req):
            return False
        digest = self._digests(req, index + 1)[index]
        return digest in self._cached or self._in_flight.get(digest, req) is not req

    def prefix_in_flight(self, req: Request) -> bool:
        """True when the first prompt block ``req`` would have to compute is being computed by another one."""
        if not self.enable_prefix_caching or not self._in_flight:
            return False
        bs = self.block_size
        for i, digest in enumerate(self._digests(req, (req.num_tokens - 1) // bs)):
            block = self._cached.get(digest)
            if block is None or self._block_key[block][1] != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                owner = self._in_flight.get(digest)
                return owner is not None and owner is not req
        return False

    def mark_in_flight(self, req: Request) -> None:
        """Note the full prompt blocks ``req`` (just admitted) will compute, so equal prefixes wait for them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        digests = self._digests(req, req.num_prompt_tokens // bs)
        for digest in digests[req.num_computed_tokens // bs :]:
            self._in_flight.setdefault(digest, req)

    def register_full_blocks(self, req: Request) -> None:
        """Make the full, computed blocks of ``req`` findable by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_ids))
        if num_full <= req.num_registered_blocks:
            return
        digests = self._digests(req, num_full)
        cut = self.reusable(req)
        for i in range(req.num_registered_blocks, num_full):
            block = req.block_ids[i]
            if self._block_key[block] is None and digests[i] not in self._cached:
                self._cached[digests[i]] = block
                self._block_key[block] = (digests[i], tuple(req.token_ids[i * bs : (i + 1) * bs]), cut)
            if self._in_flight.get(digests[i]) is req:
                del self._in_flight[digests[i]]
        req.num_registered_blocks = num_full
