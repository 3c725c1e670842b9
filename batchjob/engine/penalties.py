"""What a model's ``generation_config.json`` asks of greedy decoding: its repetition penalty, applied as
transformers' ``generate`` applies it; the other logits processors generate would build from it, refused.

The repetition penalty (HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``) divides
the logit of every token already in the request's context (its prompt and its output so far) by the penalty
where the logit is positive and multiplies it where negative. A request's ``repetition_penalty`` wins; left
out, it is the model's (Qwen2.5 and Qwen2-VL ship 1.05), else 1 (off). It changes what is drawn, greedy
draws too, not the log-probabilities reported (the model's own, as ``logprobs.py`` says). A row answering
one of ``choices`` is not penalised: its answer is the choice the model's own distribution ranks first.

The sampling settings of a generation config (``do_sample``, ``temperature``, ``top_p``, ``top_k``) are not
taken: a job's are its own (greedy unless asked). The processors below, and generate's stop strings and token
healing, are not built here; a model whose config sets one is refused, naming it, rather than answering
otherwise than ``generate`` would.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from batchjob.engine.feature import RequestFeature
from batchjob.engine.request import Request
from batchjob.errors import ConfigError
from batchjob.models import generation_config_file

# generation config field -> its value when it does nothing (None: unset)
_NOT_BUILT = {
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "min_new_tokens": 0,
    "forced_eos_token_id": None,
    "forced_bos_token_id": None,  # a decoder's too: generate forces it first after a one-token prompt
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "encoder_repetition_penalty": 1.0,  # (generate applies it to a decoder's prompt tokens too)
    "num_beams": 1,  # beam search, not a processor: another decoding altogether
    "penalty_alpha": None,  # contrastive search
    "dola_layers": None,
    "stop_strings": None,  # a stopping criterion, not a processor: generate (given the tokenizer) stops there
    "token_healing": False,  # generate re-tokenizes the prompt's tail before answering
}
# how to go on without a refused setting, where there is more to say than to remove it
_INSTEAD = {
    "stop_strings": "; to stop at those strings, give each as --stop (it cuts the text before the string, "
    "where generate keeps it in the answer)",
}


def model_penalty(model: Any, task: str, folder: str = "") -> float:
    """A generating model's repetition penalty (1: none; a prefill-only task draws nothing); refuses a
    generation config asking for a processor not built here. ``folder``: where the model was loaded from
    (a hub id too; "" when not known), for the refusal to name the file the setting is in."""
    return config_penalty(getattr(model, "generation_config", None), task, generation_config_file(folder))


def config_penalty(generation_config: Any, task: str, file: str | None = None) -> float:
    """``model_penalty`` of a model whose generation config is ``generation_config`` (a ``GenerationConfig``,
    or None), read from the model's ``file`` (generation_config.json, or config.json where the model has no
    generation_config.json; None: not known): the same rule for the loaded model and for ``validate``, which
    reads the config alone."""
    if generation_config is None or task != "generate":
        return 1.0
    for name, neutral in _NOT_BUILT.items():
        value = getattr(generation_config, name, None)
        if value not in (None, neutral, [], {}):
            raise _refusal(f"{name} = {value!r}", file, _INSTEAD.get(name, ""))
    min_length = getattr(generation_config, "min_length", None) or 0
    if min_length > 1:  # generate holds EOS back until prompt + output reach it
        raise _refusal(f"min_length = {min_length!r}", file)
    penalty = getattr(generation_config, "repetition_penalty", None)
    return 1.0 if penalty is None else float(penalty)


def _refusal(setting: str, file: str | None, instead: str = "") -> ConfigError:
    where = f"the model's {file}" if file else "the model's generation config"
    if file == "config.json":  # transformers makes the generation config of it
        where += " (it has no generation_config.json: generate reads its settings from config.json)"
    remove = f"from its {file}" if file else "from its generation_config.json (or config.json if it has none)"
    return ConfigError(
        f"{where} sets {setting}, which transformers' generate applies to every answer and batchjob does not "
        "build: its answers would differ without a word. To run without it, copy the model folder and remove "
        f"the setting {remove}{instead}"
    )


class RepetitionPenalty(RequestFeature):
    """Each penalised row's context tokens, their logits scaled before the draw; ``default``: the model's."""

    def __init__(self, default: float) -> None:
        self.default = default
        self.seen: weakref.WeakKeyDictionary[Request, _Seen] = weakref.WeakKeyDictionary()
        self.used = False  # a request had a penalty: before one has, a step costs nothing here

    def admit(self, req: Request) -> None:
        given = req.params.repetition_penalty
        penalty = self.default if given is None else given
        req.penalty = None if penalty == 1.0 or req.params.choices is not None else penalty
        self.used |= req.penalty is not None

    def mask(self, rows: list[Request], logits: torch.Tensor) -> torch.Tensor:
        if not self.used:
            return logits
        picked = [(i, r) for i, r in enumerate(rows) if r.penalty is not None]
        if not picked:
            return logits
        out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        # drafts are off for these rows (speculative.can_draft): a row's context is its tokens so far
        ids = [self._ids(r) for _, r in picked]
        sizes = torch.tensor([len(x) for x in ids])
        where = torch.tensor([i for i, _ in picked]).repeat_interleave(sizes).to(out.device)
        penalty = torch.tensor([r.penalty for _, r in picked], dtype=out.dtype).repeat_interleave(sizes)
        index = torch.cat(ids).to(out.device)
        score = out[where, index]
        penalty = penalty.to(out.device)
        out[where, index] = torch.where(score < 0, score * penalty, score / penalty)
        return out

    def _ids(self, req: Request) -> torch.Tensor:
        """The distinct ids of the request's context, kept as it grows (a step adds one token a row)."""
        seen = self.seen.get(req)
        if seen is None:
            seen = self.seen[req] = _Seen()
        fresh = [t for t in dict.fromkeys(req.token_ids[seen.absorbed :]) if t not in seen.ids]
        seen.absorbed = len(req.token_ids)
        if fresh:
            seen.ids.update(fresh)
            seen.tensor = torch.cat([seen.tensor, torch.tensor(fresh, dtype=torch.int64)])
        return seen.tensor


@dataclass
class _Seen:
    ids: set[int] = field(default_factory=set)
    tensor: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    absorbed: int = 0  # tokens of the request's context already in ``ids``
