"""Constrained decoding as a request feature (feature.py): each constrained request gets its constraint at
admission (constraints.py: a choice trie or a compiled grammar), the step's bitmask is computed on a thread
beside the forward, the logits of the constrained rows are masked before the draw, and each drawn token
advances its request's constraint. The per-request state is ``Request.constraint``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from batchjob.engine.constraints import (
    ChoiceConstraint,
    ChoiceTrie,
    Constraint,
    GrammarCompiler,
    GrammarConstraint,
    choice_trie,
    fill_bitmask,
)
from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request
from batchjob.engine.sampler import apply_bitmask
from batchjob.sampling import SamplingParams


class Constraints(RequestFeature):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # the context: a grammar's answer must close before it too
        self.stop_ids = sorted(eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # built on the first json_schema or regex
        self._tries: dict[tuple[str, ...], ChoiceTrie] = {}
        self._pool: ThreadPoolExecutor | None = None  # computes masks while the forward runs
        self._masks: Future | None = None  # this step's, when a row is constrained
        self._rows: list[Request] = []

    def admit(self, req: Request) -> None:
        if req.params.constrained:  # its room: the context left after the prompt (a resumed output not in it)
            req.constraint = self._new(req.params, self.max_model_len - req.num_prompt_tokens)

    def replay(self, req: Request) -> str | None:
        c = req.constraint
        if c is None:
            return None
        for i, tok in enumerate(req.output_ids):
            if isinstance(c, GrammarConstraint) and c.finishing and not c.steered:
                assert self._grammars is not None
                self._grammars.replay_steering(c)
            if not c.advance(tok):
                return f"resumed output token {tok} at position {i} breaks the request's constraint"
        return None

    def _new(self, params: SamplingParams, room: int) -> Constraint:
        if params.choices is not None:
            trie = self._tries.get(tuple(params.choices))
            if trie is None:
                trie = self._tries[tuple(params.choices)] = choice_trie(self.tokenizer, params.choices)
            return ChoiceConstraint(trie, self.stop_ids)
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._grammars.new(params, room)

    def before_forward(self, rows: list[Request]) -> None:
        """Compute the bitmask of the constrained rows about to sample, on a thread beside the forward."""
        self._masks, self._rows = None, []
        constraints = [r.constraint for r in rows]
        if all(c is None for c in constraints):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjob-masks")
        self._rows = rows
        self._masks = self._pool.submit(fill_bitmask, constraints, self.vocab_size, self._grammars)

    def mask(self, rows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        if self._masks is None:
            return logits
        mask = self._masks.result()
        if mask is None:
            return logits
        # The masks are numbered by request; a request verifying drafts has several rows (a constrained
        # one never drafts, so its row is its first).
        bitmask, owners = mask
        first = [i for i, r in enumerate(rows) if i == 0 or rows[i - 1] is not r]
        assert [rows[i] for i in first] == self._rows, "the rows sampled are not the rows masked"
        return apply_bitmask(logits, bitmask, [first[j] for j in owners])

    def after_sample(self, rows: list[Request], tokens: list[int]) -> None:
        """Advance each constrained request by its token (a constrained request never drafts: one row)."""
        if self._masks is None:
            return
        self._masks = None
        for req, tok in zip(rows, tokens, strict=True):
            c = req.constraint
            if c is not None and not c.advance(tok):
                req.error = f"the constraint allowed no token at output position {req.num_output_tokens}"
