"""Why a generation request cannot run: the checks at admission. A request that fails one does not raise;
it finishes with that error at the next step (the prefill-only tasks have their own, engine/tasks/).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.features.base import StopRule
from batchjob.engine.request import Request


def check_request(
    req: Request, max_model_len: int, vocab_size: int, bm: BlockManager, rules: Sequence[StopRule]
) -> str | None:
    """Its error: empty, its prompt past the context, a token outside the vocabulary, a stop rule that could
    never act as it asks, or more KV blocks than the pool has for its longest output (``max_new_tokens``, or
    a stop rule's own bound); else None."""
    n = req.num_prompt_tokens
    if n == 0:
        return "empty prompt: no tokens"
    if req.num_tokens >= max_model_len:
        return f"prompt of {n} tokens does not fit the model's context of {max_model_len} tokens"
    if req.images is not None and req.images.error:
        return req.images.error
    bad = [t for t in req.token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary (size {vocab_size})"
    refused = next((e for rule in rules if (e := rule.error(req)) is not None), None)
    if refused is not None:
        return refused
    limits = (rule.limit(req) for rule in rules)  # a rule's bound (a choice's longest answer) replaces it
    new = next((b for b in limits if b is not None), req.params.max_new_tokens)
    # Its last token is sampled and never computed, so its KV is never written: a request of k blocks' worth
    # of tokens and one more fits k blocks (the drafts of speculative decoding stop before it too).
    kv = min(n + new, max_model_len) - 1
    need = bm.blocks_for(kv)
    if need > bm.num_blocks:
        return (
            f"request needs {need} KV blocks of {bm.block_size} tokens for the {kv} tokens it computes (its "
            f"prompt and output but the last token), but the pool has {bm.num_blocks}; raise num_blocks or "
            "kv_memory_gb"
        )
    return None
