"""A row whose logits are not finite (NaN or inf: the model overflowed, as float16's small range lets a large
activation do) is its request's error, never an answer. The draw takes the largest value and counts NaN as
the largest (``sampler.argmax_rows``; Gumbel noise added to NaN stays NaN), so a row of NaN logits draws a
token whose logit is NaN: one gather at the drawn tokens finds it, whatever the vocabulary's size. A row whose
draw a constraint masks, or whose log-probabilities are reported, could draw a finite token beside a NaN or
inf one (its probabilities NaN, its choice a fallback): those rows, and a choice's scoring helpers (whose
owner's error it is), are checked whole."""

from __future__ import annotations

import torch

from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request


class FiniteLogits(RequestFeature):
    def __init__(self) -> None:
        self._logits: torch.Tensor | None = None  # this step's, before any mask
        self._bad: list[int] = []  # rows checked whole that hold a NaN or inf

    def see_logits(self, rows: list[Request], logits: torch.Tensor) -> None:
        self._logits = logits
        whole = [
            i
            for i, r in enumerate(rows)
            if r.constraint is not None or r.logprobs is not None or r.score_node is not None
        ]
        if whole:
            index = torch.tensor(whole, device=logits.device)
            finite = torch.isfinite(logits.index_select(0, index)).all(dim=-1)
            self._bad = [whole[j] for j in (~finite).nonzero().flatten().tolist()]

    def after_sample(self, rows: list[Request], tokens: list[int]) -> None:
        logits, bad, self._logits, self._bad = self._logits, self._bad, None, []
        if logits is None or not tokens:
            return
        drawn = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        for i in {*bad, *(~torch.isfinite(drawn)).nonzero().flatten().tolist()}:
            req = rows[i].owner or rows[i]  # a choice's scoring helper: its owner's answer
            req.error = req.error or (
                f"the model's logits are not finite (NaN or inf) at output token {req.num_output_tokens + 1}: "
                "it overflowed (float16's range is small: run it in bfloat16 or float32)"
            )
