"""Top-K log-probabilities as a request feature (feature.py): a request with ``logprobs=K`` gets, for each
token it generates, the K most likely tokens of the model's own distribution (before temperature, filters or
constraints) and its token's own. The state is ``Request.logprobs`` (a ``LogprobState``).

A resumed request's output ids are not taken as computed: they are replayed, one per step, in place of the
draw, so that their log-probabilities are computed again and the output equals an uninterrupted run's.
"""

from __future__ import annotations

import torch

from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import LogprobState, Request
from batchjob.engine.sampler import top_logprobs


class Logprobs(RequestFeature):
    def __init__(self) -> None:
        self._want: list[int] = []  # this step's rows that asked
        self._raw: torch.Tensor | None = None  # their logits, before any mask

    def admit(self, req: Request) -> None:
        if req.params.logprobs is None:
            return
        output = req.output_ids
        req.logprobs = LogprobState(replay=output or None)
        del req.token_ids[req.num_prompt_tokens :]  # taken again, one a step, by after_sample

    def see_logits(self, rows: list[Request], logits: torch.Tensor) -> None:
        want = [i for i, r in enumerate(rows) if r.logprobs is not None]
        self._want = want
        self._raw = logits.index_select(0, torch.tensor(want, device=logits.device)) if want else None

    def after_sample(self, rows: list[Request], tokens: list[int]) -> None:
        want, raw = self._want, self._raw
        self._want, self._raw = [], None
        if raw is None:
            return
        for i in want:
            lp = rows[i].logprobs
            assert lp is not None
            if lp.replay is not None:
                n = rows[i].num_output_tokens
                tokens[i] = lp.replay[n]
                if n + 1 == len(lp.replay):
                    lp.replay = None
        ks = [rows[i].params.logprobs for i in want]
        tops = top_logprobs(raw, list(range(len(want))), ks, [tokens[i] for i in want])
        for i, top in zip(want, tops, strict=True):
            rows[i].logprobs.top.append(top)  # type: ignore[union-attr]


def output_to_resume(req: Request) -> list[int]:
    """The output ids a checkpoint keeps: a request still replaying its resumed tokens keeps all of them."""
    replay = req.logprobs.replay if req.logprobs is not None else None
    return list(replay if replay is not None and len(replay) > req.num_output_tokens else req.output_ids)
