"""Choices: the answer is one of a few strings, and the output carries log P(choice | prompt) for each.

A choice request decodes down its ``ChoiceTrie`` under a mask (constraints.py), and every step it records the
log-probabilities of the children of the trie node it stands at. The trie nodes off its path are scored when
it has finished: a scoring request per node, the prompt followed by the node's prefix, queued at the front.
It takes the prompt's KV blocks from the prefix cache, computes only the prefix, and hands the
log-softmax of its last position to the request it scores for instead of sampling. The request's output
waits until all of them are in; then each choice's log-probability is the sum over its tokens.

With greedy sampling the answer is the most likely whole choice, which a token-by-token walk can miss when
choices share a first token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from batchjob.engine.constraints import ChoiceConstraint
from batchjob.engine.request import Request
from batchjob.engine.sampler import log_softmax
from batchjob.sampling import SamplingParams


@dataclass(eq=False)
class ScoreTarget:
    """What a scoring request scores: trie node ``node`` of ``owner``'s choices."""

    owner: Request
    node: int


def is_choice(req: Request) -> bool:
    return isinstance(req.constraint, ChoiceConstraint)


def scoring_requests(req: Request) -> list[Request]:
    """The scoring requests a finished choice request needs: one per trie node its decoding did not see."""
    c = req.constraint
    if not isinstance(c, ChoiceConstraint) or req.error or not c.done:
        return []
    out = []
    for node in c.missing_nodes:
        prefix = list(c.trie.nodes[node].prefix)
        scorer = Request(
            f"{req.request_id}@{node}",
            req.prompt_ids + prefix,
            req.num_prompt_tokens + len(prefix),
            SamplingParams(max_new_tokens=1, temperature=0.0),
            time.monotonic(),
        )
        scorer.score = ScoreTarget(req, node)
        out.append(scorer)
    return out


def record(rows: list[Request], logits: torch.Tensor) -> None:
    """Keep what the choices need from a step's logits (``logits[i]`` belongs to ``rows[i]``): the children's
    log-probabilities at a choice request's current node, and at the node a scoring request scores."""
    idx = [i for i, r in enumerate(rows) if r.score is not None or isinstance(r.constraint, ChoiceConstraint)]
    if not idx:
        return
    lp = log_softmax(logits.index_select(0, torch.tensor(idx, device=logits.device)))
    for j, i in enumerate(idx):
        r = rows[i]
        if r.score is not None:
            c = r.score.owner.constraint
            assert isinstance(c, ChoiceConstraint)
            c.record(lp[j], node=r.score.node)
        else:
            assert isinstance(r.constraint, ChoiceConstraint)
            r.constraint.record(lp[j])


def scored(scorer: Request) -> Request | None:
    """Count a scoring request in; returns the request it scored for once that one has all its scores."""
    assert scorer.score is not None
    owner = scorer.score.owner
    c = owner.constraint
    assert isinstance(c, ChoiceConstraint) and c.pending_scores > 0
    c.pending_scores -= 1
    return owner if c.pending_scores == 0 else None


def answer(req: Request) -> tuple[dict[str, float], tuple[list[int], str] | None]:
    """The choices' log-probabilities, and the answer (its token ids and text) if the request has one."""
    c = req.constraint
    assert isinstance(c, ChoiceConstraint)
    logprobs = c.choice_logprobs()
    best = c.choice
    if req.params.greedy and all(math.isfinite(v) for v in logprobs.values()):
        best = max(range(len(c.trie.choices)), key=lambda i: logprobs[c.trie.choices[i]])
    if best is None:
        return logprobs, None
    return logprobs, (list(c.trie.token_ids[best]), c.trie.choices[best])


def pending(req: Request) -> int:
    """Scoring requests a finished choice request still waits for (0 for any other request)."""
    c = req.constraint
    return c.pending_scores if isinstance(c, ChoiceConstraint) else 0
