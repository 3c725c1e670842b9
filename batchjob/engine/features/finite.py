"""A drawn token whose logit is not finite (NaN or inf: the model overflowed, as float16's small range lets a
large activation do) is its request's error, never an answer. The draw takes the largest value and counts
NaN as the largest (``sampler.argmax_rows``; Gumbel noise added to NaN stays NaN), so a row with NaN logits
draws a token whose logit is NaN: one gather at the drawn tokens finds it, whatever the vocabulary's size."""

from __future__ import annotations

import torch

from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request


class FiniteLogits(RequestFeature):
    def __init__(self) -> None:
        self._logits: torch.Tensor | None = None  # this step's, before any mask

    def see_logits(self, rows: list[Request], logits: torch.Tensor) -> None:
        self._logits = logits

    def after_sample(self, rows: list[Request], tokens: list[int]) -> None:
        logits, self._logits = self._logits, None
        if logits is None or not tokens:
            return
        drawn = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        for i in (~torch.isfinite(drawn)).nonzero().flatten().tolist():
            req = rows[i]
            req.error = req.error or (
                f"the model's logits are not finite (NaN or inf) at output token {req.num_output_tokens + 1}: "
                "it overflowed (float16's range is small: run it in bfloat16 or float32)"
            )
