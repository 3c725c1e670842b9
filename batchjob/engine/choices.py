"""Choices: the answer is one of a few strings, and the output carries log P(choice | prompt) for each.

A request feature (feature.py). A choice request decodes down its ``ChoiceTrie`` under a mask (masks.py,
constraints.py), and every step it records the log-probabilities of the children of the trie node it stands
at. The trie nodes off its path are scored when it has finished: a helper request per node (its ``owner``
the choice request, ``score_node`` the node), the prompt followed by the node's prefix, queued at the front.
It takes the prompt's KV blocks from the prefix cache, computes only the prefix, and hands the log-softmax
of its last position to its owner's constraint; the token it draws is dropped. The owner's output waits
until all of them have run; then each choice's log-probability is the sum over its tokens.

The answer is decided over whole choices, not by the walk's tokens (which pick each token among the trie's
children, renormalised there: 'ab' beside 'c' took 'a' at 0.67 where P('ab') was 1e-5). Greedy answers the
most likely whole choice; sampling draws a choice from the choices' log-probabilities as the sampler draws a
token from the vocabulary (temperature, top-k, top-p, min-p, then the noise of the request's seed and key at
a position of its own), so a row's label is the same alone or in a crowd, after a preemption and a resume.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from batchjob.engine.constraints import ChoiceConstraint
from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request, helper_id
from batchjob.engine.sampler import draw, log_softmax
from batchjob.sampling import SamplingParams


def is_choice(req: Request) -> bool:
    return isinstance(req.constraint, ChoiceConstraint)


class ChoiceScores(RequestFeature):
    def see_logits(self, rows: list[Request], logits: torch.Tensor) -> None:
        record(rows, logits)

    def helpers(self, req: Request) -> list[Request]:
        return scoring_requests(req)


def scoring_requests(req: Request) -> list[Request]:
    """The scoring requests a finished choice request needs: one per trie node its decoding did not see."""
    c = req.constraint
    if not isinstance(c, ChoiceConstraint) or req.error or not c.done:
        return []
    out = []
    for node in c.missing_nodes:
        prefix = list(c.trie.nodes[node].prefix)
        scorer = Request(
            helper_id(req.request_id, f"choice{node}"),
            req.prompt_ids + prefix,
            req.num_prompt_tokens + len(prefix),
            SamplingParams(max_new_tokens=1, temperature=0.0),
            time.monotonic(),
        )
        scorer.score_node = node
        out.append(scorer)
    return out


def record(rows: list[Request], logits: torch.Tensor) -> None:
    """Keep what the choices need from a step's logits (``logits[i]`` belongs to ``rows[i]``): the children's
    log-probabilities at a choice request's current node, and at the node a scoring request scores."""
    idx = [
        i
        for i, r in enumerate(rows)
        if r.score_node is not None or isinstance(r.constraint, ChoiceConstraint)
    ]
    if not idx:
        return
    lp = log_softmax(logits.index_select(0, torch.tensor(idx, device=logits.device)))
    for j, i in enumerate(idx):
        r = rows[i]
        if r.score_node is not None:
            assert r.owner is not None and isinstance(r.owner.constraint, ChoiceConstraint)
            r.owner.constraint.record(lp[j], node=r.score_node, top_k=r.owner.params.logprobs)
        else:
            assert isinstance(r.constraint, ChoiceConstraint)
            r.constraint.record(lp[j], top_k=r.params.logprobs)


class Answer(NamedTuple):
    """What a finished choice request reports: each choice's log-probability (None with no answer), the
    answer's token ids and text (None: no answer, the request's error or ``cut_short`` says why), and an
    error of the choices' own."""

    logprobs: dict[str, float] | None
    token_ids: list[int] | None = None
    text: str | None = None
    error: str | None = None
    top: list[list[tuple[int, float]]] | None = None  # with logprobs=K: the answer's tokens' top K


def answer(req: Request) -> Answer:
    """The choices' log-probabilities and the answer: with greedy sampling the most likely whole choice, else
    one drawn from the whole choices' log-probabilities (``drawn_choice``). A choice that could not be scored makes the row an error: the most likely one is
    then unknown, and the probabilities renormalised over the rest would overstate them."""
    c = req.constraint
    assert isinstance(c, ChoiceConstraint)
    if not c.done:
        return Answer(None)
    logprobs = c.choice_logprobs()
    unscored = [i for i, name in enumerate(c.trie.choices) if math.isnan(logprobs[name])]
    if unscored:
        return Answer(None, error=unscored_error(req, c, unscored[0]))
    values = [logprobs[name] for name in c.trie.choices]
    best = max(range(len(values)), key=values.__getitem__) if req.params.greedy else drawn_choice(req, values)
    # The log-probabilities along the answer's own path: the answer need not be the walk's tokens, and
    # a choice that a longer one goes on from ends with a stop token that is not among its tokens.
    top = None if req.params.logprobs is None else c.path_logprobs(best)
    return Answer(logprobs, list(c.trie.token_ids[best]), c.trie.choices[best], top=top)


# The output position whose noise draws a sampled label: past any token's (a context is far below 2**32),
# so the label's draw is not a token's.
LABEL_POSITION = 2**32 - 1


def drawn_choice(req: Request, logprobs: list[float]) -> int:
    """A sampled request's label: drawn from the choices' whole log-probabilities at the request's
    temperature, top-k, top-p and min-p, with its seeded noise (sampler.draw, as a token is drawn)."""
    x = torch.tensor([logprobs], dtype=torch.float64)
    return int(draw(x, [req.params], [req.key], [LABEL_POSITION])[0])


def unscored_error(req: Request, c: ChoiceConstraint, choice: int) -> str:
    """Why choice ``choice`` has no log-probability: the scoring request of a node on its path did not fit
    the context (features/helpers.py skips it)."""
    node, prefix = 0, 0
    for t in c.trie.token_ids[choice]:
        if node not in c.node_logprobs:
            break
        node, prefix = c.trie.nodes[node].children[t], prefix + 1
    return (
        f"the choice {c.trie.choices[choice]!r} could not be scored: the prompt's {req.num_prompt_tokens} "
        f"tokens and the choice's first {prefix} reach the end of the model's context; shorten the prompt "
        "or raise --max-model-len"
    )
