"""Rotary frequencies that transformers picks by the length of a forward, picked per row here.

``longrope`` scaling (Phi-3 128k, Phi-3.5-mini, Phi-4-mini) rotates with a short set of frequencies until a forward's
largest position passes ``original_max_position_embeddings``, then with a long set, and transformers picks the
set once for the whole forward (``dynamic_rope_update``). A packed step holds many rows, so one long row would
move every row beside it to the long set: answers that depend on what shares the step. HF ``generate`` on one
row takes the long set for all of a row longer than that length: its prompt, or, when its output makes it
longer, its whole cache computed again at that token (``Phi3ForCausalLM.prepare_inputs_for_generation``).
:class:`LongRope` does the same per row: a request longer than the switch when it is queued takes the long
set for every token (``Request.long_rope``), and a running one whose output passes the switch is preempted and
computed again with it (scheduler.py). Its KV blocks are keyed by the set (block_manager.py), so a prefix
rotated with one set never serves a row of the other. The families whose ``generate`` does that are the ones
this is built for; another family with longrope is refused past the switch (its ``generate`` switches
mid-row, without computing again).

``dynamic`` (NTK) scaling changes its frequencies only past ``max_position_embeddings``, which bounds the
engine's context (config.py), so it never changes them here.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from batchjob.engine.request import Request
from batchjob.errors import ConfigError

# Families whose ``generate`` computes a row's cache again with the long set when its output passes the switch,
# and whose rotary module reads its ``inv_freq`` (Phi-3.5-MoE's computes its short set and a scale by the
# forward's length itself: refused past the switch).
RECOMPUTING = {"phi3"}


def longrope_length(model_config) -> int | None:
    """The original context of a model with ``longrope`` scaling (None: it has none)."""
    params = getattr(model_config.get_text_config(), "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    return int(params["original_max_position_embeddings"])


def check(model_config, max_model_len: int, sharded: bool) -> None:
    """Refuse a context past a longrope switch where rows cannot each take their set: a family whose
    ``generate`` switches otherwise, or tensor-parallel ranks (they receive no per-row set)."""
    original = longrope_length(model_config)
    if original is None or max_model_len <= original:
        return
    if model_config.model_type not in RECOMPUTING:
        why = "in a way batchjob does not follow per row"
    elif sharded:
        why = "and batchjob picks them per row only without tensor parallelism"
    else:
        return
    raise ConfigError(
        f"{model_config.model_type} uses longrope rotary scaling, whose frequencies change past {original} "
        f"tokens, {why}; cap the context with --max-model-len {original}"
    )


class LongRope:
    """Each packed token's rotary set in a model's ``longrope`` modules; None where the context never passes
    their original length."""

    def __init__(self, modules: list, original: int) -> None:
        self.original = original
        self._long: torch.Tensor | None = None  # the step's per-token choice while it runs; None: all short
        for module in modules:
            self._wrap(module)

    @classmethod
    def install(cls, model, max_model_len: int) -> LongRope | None:
        original = longrope_length(model.config)
        if original is None or max_model_len <= original:
            return None
        modules = [m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"]
        if not modules:  # transformers' own switch would then pick one set for the whole step
            raise ConfigError(
                f"{model.config.model_type} declares longrope rotary scaling in a module batchjob does not "
                f"know; cap the context with --max-model-len {original}"
            )
        return cls(modules, original)

    def admit(self, req: Request) -> None:
        """A request queued with no KV computed: its set, by its length (any prefix digests were the other
        set's)."""
        req.long_rope = req.num_tokens > self.original
        req.block_digests = []

    def crossed(self, running: list[Request]) -> list[Request]:
        """The running requests whose last token took them past the switch: computed with the short set."""
        return [r for r in running if not r.long_rope and r.num_tokens > self.original]

    def flags(self, reqs: list[Request], n: np.ndarray) -> np.ndarray | None:
        """[T] whether each packed token takes the long set (None: none does)."""
        rows = np.array([r.long_rope for r in reqs], dtype=bool)
        return np.repeat(rows, n) if rows.any() else None

    def set(self, flags: np.ndarray | None, device: torch.device) -> None:
        """The step's choice, for the modules' next forward."""
        self._long = None if flags is None else torch.from_numpy(flags).to(device)

    def _wrap(self, module) -> None:
        plain = inspect.unwrap(type(module).forward)  # the forward without transformers' per-forward update
        short = module.original_inv_freq.clone()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # heavy: only with a longrope model

        # the long set as transformers computes it on a forward past the original length
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, short.device, seq_len=self.original + 1)

        def forward(x, position_ids):
            module.inv_freq.copy_(short)
            cos, sin = plain(module, x, position_ids)
            if self._long is None:
                return cos, sin
            module.inv_freq.copy_(long)
            cos_long, sin_long = plain(module, x, position_ids)
            pick = self._long.view(1, -1, 1)
            return torch.where(pick, cos_long, cos), torch.where(pick, sin_long, sin)

        module.forward = forward
