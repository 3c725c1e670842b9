"""Speculative decoding by prompt lookup: draft tokens copied from the request's own context.

When the last few tokens of a decoding request (an n-gram, 3 tokens, else 2) occurred earlier in its prompt
or output, the tokens that followed them there are proposed as its next ones. The forward then computes the
request's last token and the drafts together, as one chunk of ``1 + k`` tokens; the sampler draws a token at
every position of the chunk, and the drafts are kept while each equals the token drawn before it. A token's
draw depends only on the logits and (seed, request, position), greedy or sampled, so the output is the one
that decoding a token at a time gives (up to the float rounding of a different batch shape), in fewer
forwards when the output repeats its context: extraction, summaries, code, and the loops that small models
fall into.

Drafts live only inside one ``Engine.step()``: proposed before scheduling, trimmed to what the scheduler
gave the request, resolved after sampling. A checkpoint or a preemption never sees them.
"""

from __future__ import annotations

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.ngram import SpecState
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput

BACKOFF_STEPS = 4  # after a draft that was wholly rejected, steps before the request drafts again


def can_draft(req: Request) -> bool:
    """Decoding, and nothing that needs the model's distribution token by token (constraints, log-probs
    and their replayed tokens, helper requests such as choices' scoring requests)."""
    return (
        req.num_computed_tokens == req.num_tokens - 1
        and req.constraint is None
        and req.logprobs is None
        and req.owner is None
    )


def propose(req: Request, k: int) -> list[int]:
    """At most ``req.spec.window`` drafts (which grows while drafts are kept, see ``record``)."""
    if req.spec is None:
        req.spec = SpecState()
    spec = req.spec
    if spec.backoff > 0:
        spec.backoff -= 1
        return []
    return spec.ngrams.propose(req.token_ids, min(k, spec.window))


def record(req: Request, proposed: int, kept: int) -> None:
    """Slow start: a request drafts one token at first and doubles its window each time all its drafts
    are kept; a rejection sends it back to one, and a draft rejected outright rests it a few steps. Text
    that rarely repeats its context then costs about one wasted row per few steps, while a request that
    loops soon drafts the full window."""
    if req.spec is None:
        req.spec = SpecState()
    if kept == proposed:
        req.spec.window = min(2 * req.spec.window, 64)
    else:
        req.spec.window = 1
        if kept == 0:
            req.spec.backoff = BACKOFF_STEPS


def draft(running: list[Request], bm: BlockManager, max_drafts: int, max_model_len: int) -> list[Request]:
    """Append drafts to the running requests that can take them; returns those requests. The pool keeps a
    block per running request spare: drafting must never be the reason a request is preempted."""
    spare = bm.num_free_blocks - len(running)
    drafted = []
    for req in running:
        if spare <= 0:
            break
        left = min(req.params.max_new_tokens - req.num_output_tokens, max_model_len - req.num_tokens)
        k = min(max_drafts, left - 1)  # the token drawn after the drafts counts too
        if k <= 0 or not can_draft(req):
            continue
        tokens = propose(req, k)
        if not tokens:
            continue
        extra = bm.num_missing(req, req.num_tokens + len(tokens)) - bm.num_missing(req, req.num_tokens)
        if extra > spare:
            continue
        spare -= extra
        req.token_ids.extend(tokens)
        req.num_draft_tokens = len(tokens)
        drafted.append(req)
    return drafted


def trim(drafted: list[Request], plan: SchedulerOutput) -> None:
    """Keep only the drafts the plan computes: none for a request it left out or preempted."""
    given = {id(r): n for r, n in zip(plan.requests, plan.num_tokens, strict=True)}
    for req in drafted:
        n = given.get(id(req))
        keep = 0 if n is None else min(req.num_draft_tokens, n - 1)
        if keep < req.num_draft_tokens:
            del req.token_ids[len(req.token_ids) - (req.num_draft_tokens - keep) :]
            req.num_draft_tokens = keep
