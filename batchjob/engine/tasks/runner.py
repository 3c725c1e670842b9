"""Prefill-only tasks: ``embed``, ``classify`` and ``score``. A request of these is a prompt with no decode.

It is scheduled and packed like any prompt (chunked when longer than the step's budget; an encoder's row,
attended both ways, always whole in one step), its result is made from the hidden states the forward
returns for its rows, and it finishes in the step that computes its last token, which frees its KV blocks
at once (the full ones stay findable in the prefix cache: score requests sharing a prompt reuse them).
The task is the engine's (``Engine.from_pretrained(model, task=...)``, the option ``task``); each request's
state is a :class:`~.state.TaskState` on ``Request.task``.

The result, on :class:`~batchjob.engine.output.RequestOutput` (fields None for other tasks and errors):

- ``embed``: ``embedding``, a 1-D numpy array (the model's dtype; float32 for half dtypes): the pooled last
  hidden state (``cls``: the first token's, ``mean``: the mean of all tokens', ``last``: the last token's),
  cut to ``dimensions`` and scaled to unit length when ``normalize`` (a folder's ``truncate_dim`` is cut
  after the scaling, as encode cuts it: ``Pooling.cut_last``). Pooling and normalisation come from
  the model folder's sentence-transformers files (``modules.json``, ``1_Pooling/config.json``: st_folder.py)
  when present, else from the options ``pooling`` (default mean) and ``normalize`` (default off); an option
  given wins. A prompt the pooling leaves out (``include_prompt`` false) is skipped: ``TaskState.pool_from``.
- ``classify``: ``logits``, a 1-D numpy array of the sequence-classification head's raw outputs, read at the
  first token for an encoder (through its pooler when it has one, as the model does) and for a decoder (a
  reward model) at the last token that is not the pad token, as transformers' head reads it; with more than one label also ``probs`` (softmax) and ``label`` (the
  ``id2label`` name of the largest); with one output ``score`` (that output, a float). As the config's
  ``problem_type`` says (``state.HEADS``): a multi-label head gives ``probs`` (a sigmoid per label) and
  ``labels`` (those above 0.5), a regression head its values alone.
- ``score``: ``logprob`` (float, the sum of the scored tokens' log-probabilities, accumulated in float64),
  ``num_scored_tokens``, and with ``token_logprobs=True`` the per-token list ``token_logprobs``. Unconditional
  (no continuation): every token of the prompt but the first is scored; conditional: only the
  continuation's tokens, each given the prompt and the continuation before it. The log-softmax is computed
  only at the scored rows, a bounded number of rows at a time, in at least float32 (bf16 logits upcast, as
  generate's log-probabilities are).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchjob.engine.attention.layout import StepLayout
from batchjob.engine.config import model_context_len
from batchjob.engine.request import Request, RequestState
from batchjob.engine.sampler import log_softmax
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.tasks import PREFILL_TASKS
from batchjob.engine.tasks.st_folder import Pooling, prompt_length, refuse_cross_encoder, resolve_pooling
from batchjob.engine.tasks.state import MULTI_LABEL_THRESHOLD, TaskState, head_kind
from batchjob.errors import ConfigError

LOGIT_ELEMENTS = 1 << 24  # score: at most this many logits (rows x vocabulary) exist at once
# Encoders whose positions start after the padding index (position ids are padding_idx + 1 + p).
_PADDED_POSITIONS = {"roberta", "xlm-roberta", "camembert"}


def position_offset(config) -> int:
    """What to add to a row's positions 0, 1, ... to get the model's position ids (RoBERTa-style encoders
    count from ``pad_token_id + 1``)."""
    if getattr(config, "model_type", None) in _PADDED_POSITIONS:
        return int(config.pad_token_id) + 1
    return 0


def classifier(model, encoder: bool, own: dict[str, torch.nn.Module] | None = None):
    """(pooled position "cls" | "last" | "mean", head: pooled rows [R, H] -> logits [R, L]) of a
    sequence-classification model, as its own forward applies it; ``own``: modules (by their name in the
    model: ``score``, ``classifier``, ModernBERT's ``head``) that replace the model's (a LoRA adapter's)."""
    name = type(model).__name__

    def module(key: str):
        return (own or {}).get(key, getattr(model, key, None))

    score = module("score")
    head = module("classifier")
    if not encoder and isinstance(score, torch.nn.Linear):
        return "last", score
    if encoder and isinstance(head, torch.nn.Linear) and model.config.model_type == "modernbert":
        # ModernBERT: classifier(head(pooled)), pooled the first token's state or the mean of all tokens'
        # (its config's classifier_pooling); the mean is divided out when the request finishes
        pooling = getattr(model.config, "classifier_pooling", "cls")
        if pooling in ("cls", "mean"):
            dense = module("head")
            return pooling, lambda h: head(dense(h))
    if encoder and head is not None:
        pooler = (own or {}).get("pooler", getattr(model.base_model, "pooler", None))
        if isinstance(head, torch.nn.Linear) and pooler is not None:  # BERT: classifier(pooler(h[:, 0]))
            return "cls", lambda h: head(pooler(h[:, None, :]))
        if not isinstance(head, torch.nn.Linear):  # RoBERTa-style heads read features[:, 0] themselves
            return "cls", lambda h: head(h[:, None, :])
    raise ConfigError(
        f"{name}'s classification head is not one batchjob applies (a decoder's `score` linear at the last "
        "token, an encoder's `classifier` at the first); use a BERT, RoBERTa, ModernBERT or decoder classifier"
    )


def _score_head(model):
    """hidden rows [R, H] -> logits [R, V], as the causal LM's forward computes them after its head."""
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"{type(model).__name__} has no language-model head to score with")
    config = model.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    scaling = getattr(config, "logits_scaling", None)  # Granite (and MiniCPM3) divide, HyperCLOVA X multiplies
    if scaling is not None and config.model_type.startswith("hyperclovax"):
        scale, scaling = scaling, None
    elif scaling is not None and not config.model_type.startswith(("granite", "minicpm3")):
        raise ConfigError(  # which way another family applies it is not known here
            f"score: model family {config.model_type!r} has logits_scaling={scaling}, which batchjob's score "
            "head applies only for the families it knows (Granite, MiniCPM3, HyperCLOVA X)"
        )
    for name in ("lm_head_multiplier", "output_multiplier", "logit_scale_factor"):
        if getattr(config, name, 1) not in (1, 1.0, None):
            raise ConfigError(
                f"score: model family {config.model_type!r} scales its logits ({name}="
                f"{getattr(config, name)}), which batchjob's score head does not apply"
            )

    def apply(h: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        if scale is not None:
            logits = logits * scale
        if scaling is not None:
            logits = logits / scaling
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


class TaskRunner:
    """Turns the hidden states of each step into the results of the prefill-only requests in it."""

    def __init__(
        self, task: str, model, *, encoder: bool, pooling: Pooling | None = None, skip: int = 0
    ) -> None:
        assert task in PREFILL_TASKS
        self.task = task
        self.encoder = encoder
        self.pooling = pooling
        self.skip = skip  # embed: leading tokens (a prompt) the pooling leaves out
        self.id2label: dict[int, str] = {}
        self.head_kind = "single"  # classify: how the head's outputs are read (state.HEADS)
        self.position = "cls"
        self.heads: dict[int, Any] = {}  # classify: a LoRA adapter's own head by adapter index (adapters.py)
        self.pad_id: int | None = None  # classify on a decoder: the pad token its head's position skips
        if task == "embed":
            assert pooling is not None
            self.position = pooling.mode
        elif task == "classify":
            self.head_kind = head_kind(model.config)
            self.position, self.head = classifier(model, encoder)
            self.id2label = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}
            if self.id2label and sorted(self.id2label) != list(range(len(self.id2label))):
                raise ConfigError(  # else an output without a name would be labelled by its index
                    f"the model's config.json numbers its labels {sorted(self.id2label)} in id2label: the head's "
                    f"outputs are 0 to {len(self.id2label) - 1}; number the labels so in id2label"
                )
            # a decoder's head reads the rightmost token that is not the pad token, as transformers' does
            # (a reward model whose pad token is its EOS was trained on that position, not the EOS's)
            self.pad_id = model.config.get_text_config().pad_token_id if self.position == "last" else None
        else:
            self.head = _score_head(model)
            self.position = "all"
            self.vocab = model.get_output_embeddings().weight.shape[0]

    def new_state(
        self, num_prompt: int, tokens: list[int], conditional: bool, token_logprobs: bool
    ) -> TaskState:
        if self.task == "score":
            score_from = num_prompt if conditional else 1
            return TaskState("score", score_from - 1, score_from, token_logprobs)
        if self.position != "last":
            return TaskState(self.task, 0, pool_from=self.skip)
        at = len(tokens) - 1
        if self.pad_id is not None:  # the rightmost token that is no pad (the first, if all are)
            at = next((i for i in range(at, -1, -1) if tokens[i] != self.pad_id), 0)
        return TaskState(self.task, at, pool_from=self.skip, read_at=at)

    # -- each step -------------------------------------------------------------------------------------

    def consume(self, plan: SchedulerOutput, lay: StepLayout, hidden: torch.Tensor) -> None:
        """Take what each request of the step needs from ``hidden`` [T, H], the step's last hidden states."""
        if self.task == "score":
            self._score(plan, lay, hidden)
            return
        if self.position == "mean":
            sums = hidden.new_zeros(len(plan.requests), hidden.shape[1])
            owner = lay.req_of_row
            if self.skip:  # a prompt's rows left out of the mean: zero them
                pos = np.arange(len(owner)) - lay.offsets[owner] + lay.starts[owner]
                hidden = hidden * torch.from_numpy(pos >= self.skip).to(hidden.device, hidden.dtype)[:, None]
            sums.index_add_(0, torch.from_numpy(owner).to(hidden.device), hidden)
            for i, req in enumerate(plan.requests):
                st = req.task
                st.pooled = sums[i] if st.pooled is None else st.pooled + sums[i]
            return
        picks, owners = [], []
        first = self.skip  # cls: the first position the pooling takes
        for i, req in enumerate(plan.requests):
            if self.position == "cls" and lay.starts[i] <= first < lay.ends[i]:
                picks.append(int(lay.offsets[i]) + first - int(lay.starts[i]))
            elif self.position == "last" and lay.starts[i] <= req.task.read_at < lay.ends[i]:
                picks.append(int(lay.offsets[i]) + req.task.read_at - int(lay.starts[i]))
            else:
                continue
            owners.append(req)
        if not picks:
            return
        rows = hidden.index_select(0, torch.tensor(picks, device=hidden.device))
        if self.task == "classify":
            rows = self._apply_heads(rows, owners)
        for req, row in zip(owners, rows, strict=True):
            req.task.pooled = row

    def _apply_heads(self, rows: torch.Tensor, owners: list[Request]) -> torch.Tensor:
        """Each row through its request's head: its adapter's own (modules_to_save), else the model's."""
        if not self.heads:
            return self.head(rows)
        groups: dict[int, list[int]] = {}
        for k, req in enumerate(owners):
            groups.setdefault(req.adapter if req.adapter in self.heads else 0, []).append(k)
        out: torch.Tensor | None = None
        for adapter, ks in groups.items():
            index = torch.tensor(ks, device=rows.device)
            logits = self.heads.get(adapter, self.head)(rows.index_select(0, index))
            out = logits.new_empty(len(owners), logits.shape[1]) if out is None else out
            out.index_copy_(0, index, logits)
        assert out is not None
        return out

    def _score(self, plan: SchedulerOutput, lay: StepLayout, hidden: torch.Tensor) -> None:
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        for i, req in enumerate(plan.requests):
            st = req.task
            start = int(lay.starts[i])
            lo = max(start, st.score_from - 1)  # the row at position p predicts the token at p + 1
            hi = min(int(lay.ends[i]), req.num_tokens - 1)
            if hi <= lo:
                continue
            first = int(lay.offsets[i]) + lo - start
            rows.extend(range(first, first + hi - lo))
            targets.extend(req.token_ids[lo + 1 : hi + 1])
            owners.extend([req] * (hi - lo))
        if not rows:
            return
        per = max(1, LOGIT_ELEMENTS // self.vocab)
        values: list[float] = []
        index = torch.tensor(rows, device=hidden.device)
        target = torch.tensor(targets, device=hidden.device)
        for c in range(0, len(rows), per):
            logits = self.head(hidden.index_select(0, index[c : c + per]))
            # in at least float32, as generate's log-probabilities: bf16's 8 bits of mantissa round each
            # token's log-probability by up to 0.03 (sampler.log_softmax)
            lp = log_softmax(logits).gather(1, target[c : c + per, None])[:, 0]
            values.extend(lp.double().tolist())
        for req, v in zip(owners, values, strict=True):
            st = req.task
            st.logprob += v
            st.num_scored += 1
            if st.keep_token_logprobs:
                st.token_logprobs.append(v)

    # -- when a request finishes -----------------------------------------------------------------------

    def finish(self, req: Request) -> None:
        """Make the request's result (``TaskState.result``: the fields of its RequestOutput)."""
        st = req.task
        assert st is not None
        if self.task == "score":
            st.result = {
                "logprob": float(st.logprob),
                "num_scored_tokens": st.num_scored,
                "token_logprobs": list(st.token_logprobs) if st.keep_token_logprobs else None,
            }
            return
        assert st.pooled is not None, f"request {req.request_id} finished without its pooled row"
        vec = st.pooled
        if self.task == "embed":
            p = self.pooling
            assert p is not None
            if p.mode == "mean":
                vec = vec / (req.num_tokens - st.pool_from)
            if p.dimensions is not None and not p.cut_last:
                vec = vec[: p.dimensions]
            if p.normalize:
                vec = F.normalize(vec, p=2, dim=0)
            if p.dimensions is not None and p.cut_last:  # the folder's truncate_dim, cut as encode cuts it
                vec = vec[: p.dimensions]
            st.result = {"embedding": _array(vec)}
            return
        if self.position == "mean":  # classify: the head takes the mean of the row's states
            vec = self.heads.get(req.adapter, self.head)((vec / req.num_tokens)[None, :])[0]
        st.result = self._classified(vec)

    def _classified(self, vec: torch.Tensor) -> dict[str, Any]:
        """A classifier's result fields from its head's outputs ``vec`` [L], read as its problem_type says."""
        logits = _array(vec)
        wide = vec.float() if vec.dtype in (torch.float16, torch.bfloat16) else vec
        if self.head_kind == "multi":  # each label on its own, as transformers' pipeline reads such a head
            probs = torch.sigmoid(wide)
            chosen = torch.nonzero(probs > MULTI_LABEL_THRESHOLD)[:, 0].tolist()
            return {"logits": logits, "probs": _array(probs), "labels": [self._name(i) for i in chosen]}
        if logits.shape[0] == 1:
            return {"logits": logits, "score": float(logits[0])}
        if self.head_kind == "regression":  # values, not scores of labels: nothing to take a softmax of
            return {"logits": logits}
        probs = torch.softmax(wide, dim=0)
        return {"logits": logits, "probs": _array(probs), "label": self._name(int(torch.argmax(vec)))}

    def _name(self, index: int) -> str:
        return self.id2label.get(index, str(index))


def _array(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.detach().cpu().numpy().copy()


def request_state(req: Request) -> RequestState:
    """What a checkpoint keeps of an unfinished prefill-only request: its prompt and, for a conditional
    score, the continuation (nothing was generated)."""
    assert req.task is not None
    conditional = req.task.kind == "score" and req.task.score_from > 1
    cont = req.output_ids if conditional else None
    return RequestState(req.request_id, req.prompt_ids, [], req.params, 0, cont, req.task.keep_token_logprobs)


def perplexity(logprob: float, num_scored_tokens: int) -> float:
    """exp(-logprob / num_scored_tokens); NaN when nothing was scored."""
    return math.exp(-logprob / num_scored_tokens) if num_scored_tokens else math.nan


def task_runner(model, tokenizer, config, model_id: str, encoder: bool) -> tuple[TaskRunner, int]:
    """The engine's task runner for ``config.task``, and the longest request it takes, in tokens: the
    model's context (less RoBERTa's position offset), capped by the sentence-transformers ``max_seq_length``
    and the tokenizer's ``model_max_length`` for embed and classify."""
    limit = model_context_len(model.config) - position_offset(model.config)
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    pooling = None
    if config.task == "embed":
        width = model.config.get_text_config().hidden_size
        dtype = str(config.dtype).removeprefix("torch.")  # its name, as the folder's files give one
        pooling = resolve_pooling(
            model_id, config.pooling, config.normalize, config.dimensions, width, config.prompt_name, dtype
        )
        if pooling.max_seq_length is not None:
            limit = min(limit, pooling.max_seq_length)
        if pooling.truncation_side is not None:  # sentence-transformers loads the tokenizer with it
            tokenizer.truncation_side = pooling.truncation_side
    elif any(getattr(config, k) is not None for k in ("pooling", "normalize", "dimensions", "prompt_name")):
        raise ConfigError(
            f"pooling, normalize, dimensions and prompt_name are options of task embed, not {config.task}"
        )
    if config.task == "classify":
        refuse_cross_encoder(model_id, model.config)
    if config.task != "score" and (pooling is None or pooling.max_seq_length is None):
        # (a folder's max_seq_length replaces the tokenizer's own limit, as sentence-transformers takes it)
        own = getattr(tokenizer, "model_max_length", None)
        if isinstance(own, int) and 0 < own < 1_000_000:
            limit = min(limit, own)
    skip = prompt_length(tokenizer, pooling) if pooling is not None else 0
    return TaskRunner(config.task, model, encoder=encoder, pooling=pooling, skip=skip), limit


def check_request(req: Request, conditional: bool, limit: int, vocab_size: int, block_manager) -> str | None:
    """Why a prefill-only request cannot run (its error output), None when it can. ``req.token_ids`` are
    already cut to ``limit`` when the option ``truncate`` is on."""
    n = req.num_tokens
    if n == 0:
        return "empty prompt: no tokens"
    if n > limit:
        return (
            f"text of {n} tokens is longer than the model's limit of {limit} tokens; set truncate "
            "(--truncate) to cut it to the limit"
        )
    if conditional and req.num_prompt_tokens >= n:
        return "nothing to score: the continuation has no tokens (or was cut off by truncate)"
    if conditional and req.num_prompt_tokens == 0:  # its first token would go unscored, without a word
        return "empty prompt: a continuation's first token needs a token before it (score it as a text alone)"
    if not conditional and req.task is not None and req.task.kind == "score" and n < 2:
        return "nothing to score: one token (the first token of a text is never scored)"
    if req.task is not None and n <= req.task.pool_from:
        return f"nothing to pool: the text's {n} tokens are all the prompt's (include_prompt is off)"
    bad = [t for t in req.token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary (size {vocab_size})"
    need = block_manager.blocks_for(n)
    if need > block_manager.num_blocks:
        return (
            f"request needs {need} KV blocks of {block_manager.block_size} tokens for {n} tokens, but the "
            f"pool has {block_manager.num_blocks}; raise num_blocks or kv_memory_gb"
        )
    return None
