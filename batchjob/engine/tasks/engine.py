"""The prefill-only engine: the core ``Engine`` built for embed, classify or score, where every request is
a prompt with no decode.

A request is scheduled and packed like any prompt (an encoder's row whole in one step, a causal row on the
chunk grid: policy.py), its result is made from that forward's hidden states (runner.py), and it finishes
in the step that computes its last token, which frees its KV blocks at once. Attention takes no separate
path for one-token rows and no decode graphs run, so a row's floats never depend on what shares its step
(LoRA adapters too: each adapter's rows gathered, a classifier adapter with its own head: adapters.py).
``Engine.from_pretrained(model, task=...)`` builds one (the factory in ``tasks/__init__.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from batchjob.engine import lora as lora_adapters
from batchjob.engine import offline
from batchjob.engine.engine import Engine
from batchjob.engine.output import RequestOutput
from batchjob.engine.plan import ModelPlan
from batchjob.engine.request import Request, RequestState, RequestStatus
from batchjob.engine.scheduler import ChunkPolicy, Scheduler, SchedulerOutput
from batchjob.engine.tasks import adapters as task_adapters
from batchjob.engine.tasks.policy import ChunkGrid, WholeRows
from batchjob.engine.tasks.runner import (
    TaskRunner,
    check_request,
    position_offset,
    request_state,
    task_runner,
)
from batchjob.engine.tasks.st_folder import input_ids, prompt_length, prompt_text
from batchjob.engine.tasks.state import TASK_CHUNK
from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams

# An encoder's step budget when the engine decides it (the CPU's default of 512 is for generation): steps
# of whole rows; the row's floats are the same at any budget. 4,096 against 512 took 14% less CPU time on
# the all-MiniLM-L6-v2 shape (BENCHMARKS.md), fewer steps and larger GEMMs.
ENCODER_STEP_TOKENS = 4096


class TaskEngine(Engine):
    """An engine for one prefill-only task (``config.task``): ``embed``, ``classify`` or ``score``, or
    ``add_request``/``step()`` as for generation."""

    tasks: TaskRunner
    decode_graphs = False  # a decode graph's padded rows would attend a one-token row another way

    def __init__(
        self, model, tokenizer, config, model_id: str = "", *, tensor_parallel=None, lora=None
    ) -> None:
        super().__init__(model, tokenizer, config, model_id, tensor_parallel=tensor_parallel)
        self.runner.rows_alike()
        self.runner.position_offset = position_offset(model.config)  # RoBERTa counts from padding_idx + 1
        if lora:  # every step gathered by adapter; a classifier adapter's own head (adapters.py)
            self.lora = task_adapters.attach_to(self, lora, tensor_parallel is not None)

    def _padded(self, tokens: list[int]) -> str | None:
        """A RoBERTa-style encoder gives a pad token inside a text the padding position, and the tokens after
        it positions one lower (transformers counts positions over the tokens that are no pad); this engine
        counts every token: such a row is refused rather than computed at other positions."""
        pad = self.model.config.pad_token_id if self.runner.position_offset else None
        if pad is None or pad not in tokens:
            return None
        return (
            f"the text holds the pad token (id {pad}, at token {tokens.index(pad)}), which this model's positions "
            "skip: leave it out of the text"
        )

    # -- the core's hooks ------------------------------------------------------------------------------

    def _request_limit(self, plan: ModelPlan) -> int:
        self.tasks, limit = task_runner(self.model, self.tokenizer, self.config, self.model_id, plan.encoder)
        return limit

    def _prefix_caching(self, plan: ModelPlan) -> bool:
        # An encoder's keys depend on the whole row: nothing of it can be reused by another. A causal task's
        # rows reuse whole chunks of the grid (score: rows sharing a prompt compute it once).
        return bool(self.config.enable_prefix_caching and not plan.encoder)

    def _scheduler(self, plan: ModelPlan) -> Scheduler:
        config = self.config
        budget = config.max_num_batched_tokens
        chunks: ChunkPolicy
        if plan.encoder:  # an encoder's row runs whole; its steps are larger when the engine decides
            if "max_num_batched_tokens" in config.decided:
                budget = max(budget, ENCODER_STEP_TOKENS)
            budget, chunks = max(budget, self.prefill_limit), WholeRows()
        else:
            # Causal rows: chunks on a fixed grid, prefixes reused only in whole chunks, so the floats a task
            # writes are the same whatever shared its steps, and after a restart.
            chunks = ChunkGrid(min(TASK_CHUNK, budget))
        return Scheduler(
            self.block_manager, budget, config.max_num_seqs, static=config.static_batching, chunks=chunks
        )

    def _execute(self, plan: SchedulerOutput) -> tuple[list[Request], list[list[int]]]:
        """The result comes from the hidden states; nothing samples."""
        hidden, lay = self.runner.hidden_states(plan)
        self.tasks.consume(plan, lay, hidden)
        return [], []

    def _update(
        self, plan: SchedulerOutput, sampling: list[Request], drawn: list[list[int]]
    ) -> list[Request]:
        """A request finishes in the step that computes its last token; its blocks are freed at once."""
        self._advance(plan)
        finished: list[Request] = []
        for req in plan.requests:
            if req.num_computed_tokens == req.num_tokens:
                self.tasks.finish(req)
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
        self._count(plan)
        return finished

    def _state_of(self, req: Request) -> RequestState:
        adapter = None if self.lora is None else self.lora.name(req.adapter)
        return replace(request_state(req), adapter=adapter)

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        output_ids: Sequence[int] | None = None,
        *,
        key: int | None = None,
        sample_index: int | None = None,
        continuation_ids: Sequence[int] | None = None,
        token_logprobs: bool = False,
        adapter: str | None = None,
    ) -> None:
        """Queue a prefill-only request (``params`` and ``output_ids`` are not used). ``score`` takes
        ``continuation_ids`` (only they are scored, given the prompt) and ``token_logprobs`` (keep the
        per-token list). Longer than ``prefill_limit`` tokens: cut to it with the option ``truncate``, else
        an error output. ``adapter``: a LoRA adapter the engine holds, by name (None: the base model)."""
        if params is not None and params.n != 1:
            raise ConfigError(f"task {self.task} takes one sample per request, got n={params.n}")
        rid = request_id
        index = lora_adapters.index_of(self.lora, adapter)
        if rid in self._requests:
            raise ConfigError(f"request id {rid!r} is already in the engine")
        if (continuation_ids is not None or token_logprobs) and self.task != "score":
            raise ConfigError(f"continuation_ids and token_logprobs are for task='score', not {self.task!r}")
        prompt = offline.token_ids(prompt_ids, f"request {rid!r}'s prompt")
        continuation = offline.token_ids(continuation_ids or (), f"request {rid!r}'s continuation")
        tokens = prompt + continuation
        if self.config.truncate and len(tokens) > self.prefill_limit:
            tokens = tokens[: self.prefill_limit]
        req = Request(rid, tokens, min(len(prompt), len(tokens)), SamplingParams(), time.monotonic())
        req.adapter = index  # (before the scheduler: it roots the request's prefix digests)
        req.task = self.tasks.new_state(
            req.num_prompt_tokens, tokens, continuation_ids is not None, token_logprobs
        )
        self._requests[rid] = req
        self.stats.prompt_tokens += len(tokens)
        req.error = check_request(
            req, continuation_ids is not None, self.prefill_limit, self.vocab_size, self.block_manager
        ) or self._padded(tokens)
        if req.error is not None:
            self._failed.append(req)
        else:
            self.scheduler.add(req)

    def tokenize(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """A text's token ids as a task request takes them: with the tokenizer's special tokens (as
        sentence-transformers and HF classifiers encode), cut to ``prefill_limit`` when ``truncate`` is on.
        embed: after the model folder's prompt, or rendered through its chat template, as its
        sentence-transformers files say (``st_folder.input_ids``)."""
        cut = self.config.truncate
        pooling = self.tasks.pooling
        if special_tokens and pooling is not None:  # embed: as sentence-transformers' encode (st_folder.py)
            return input_ids(self.tokenizer, text, pooling, self.prefill_limit if cut else None)
        return self.tokenizer(
            text,
            add_special_tokens=special_tokens,
            truncation=cut,
            max_length=self.prefill_limit if cut else None,
        ).input_ids

    def scored_ids(self, text: str) -> list[int]:
        """A scored text's token ids (score's continuation): without special tokens, and never cut alone.
        ``add_request`` cuts prompt and continuation together at the limit, from the end, so the continuation's
        first tokens are scored; the tokenizer's own cut, from a ``truncation_side`` "left", kept its last
        tokens, and the joint cut then scored a piece from its middle."""
        return list(self.tokenizer(text, add_special_tokens=False, truncation=False).input_ids)

    # -- convenience ---------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Any], sampling_params: Any = None) -> list[RequestOutput]:
        offline.params_for(prompts, sampling_params)  # its own refusals first, as the core's generate()
        raise ConfigError(
            f"generate() needs an engine built with task='generate'; this one's task is {self.task!r} "
            f"(call {self.task}() instead)"
        )

    def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        *,
        prompt_name: str | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Embed texts (or token id lists, taken as the whole input); outputs in input order, each with
        ``embedding`` (or ``error``). ``prompt_name``: which of the folder's sentence-transformers prompts
        goes before each text for this call ("" for none), as ``encode(prompt_name=...)``; None: the engine's
        (the option ``prompt_name``, else the folder's default). ``adapters``: each input's LoRA adapter name
        (None: the base model), as for ``score`` and ``classify``."""
        items = offline.prompt_list(inputs, "embed", "input")
        if prompt_name is None or self.task != "embed":
            return self._run_task("embed", items, None, False, adapters)
        kept = self.tasks.pooling, self.tasks.skip
        assert kept[0] is not None
        self.tasks.pooling = replace(kept[0], prompt=prompt_text(self.model_id, prompt_name))
        self.tasks.skip = prompt_length(self.tokenizer, self.tasks.pooling)
        try:
            return self._run_task("embed", items, None, False, adapters)
        finally:
            self.tasks.pooling, self.tasks.skip = kept

    def classify(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], *, adapters: Sequence[str | None] | None = None
    ) -> list[RequestOutput]:
        """Classify texts (or token id lists): ``logits`` and ``probs``/``label`` or ``score`` per input."""
        items = offline.prompt_list(inputs, "classify", "input")
        return self._run_task("classify", items, None, False, adapters)

    def score(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        continuations: Sequence[str] | Sequence[Sequence[int]] | None = None,
        *,
        token_logprobs: bool = False,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """The log-likelihood of each prompt (every token but the first scored), or with ``continuations``
        of each continuation given its prompt (a text continuation is tokenized without special tokens):
        ``logprob``, ``num_scored_tokens``, ``perplexity``, and ``token_logprobs`` when asked for."""
        prompts = offline.prompt_list(prompts, "score")
        conts = None
        if continuations is not None:  # one text is one continuation, as one text is one prompt
            conts = offline.prompt_list(continuations, "score", "continuation")
            if len(conts) != len(prompts):
                raise ConfigError(f"got {len(conts)} continuations for {len(prompts)} prompts")
        return self._run_task("score", prompts, conts, token_logprobs, adapters)

    def _run_task(
        self,
        task: str,
        inputs: list,
        continuations: list | None,
        token_logprobs: bool,
        adapters: Sequence[str | None] | None,
    ) -> list[RequestOutput]:
        if self.task != task:
            raise ConfigError(
                f"{task}() needs an engine built with task={task!r} (Engine.from_pretrained(..., task="
                f"{task!r})); this one's task is {self.task!r}"
            )
        if self.has_unfinished():
            raise ConfigError(f"{task}() needs an idle engine; it has unfinished requests")

        names = lora_adapters.per_prompt(self.lora, adapters, len(inputs))
        # each as generate() takes a prompt (offline.prompt_ids), all checked before any is added: a refused
        # batch leaves the engine idle
        noun = "prompt" if task == "score" else "input"
        prompts = [offline.prompt_ids(x, f"{noun} {i}", self.tokenize) for i, x in enumerate(inputs)]
        conts: list[list[int] | None] = [None] * len(inputs)
        if continuations is not None:  # (a None among them is refused: it is no continuation)
            conts = [
                offline.prompt_ids(c, f"continuation {i}", self.scored_ids)
                for i, c in enumerate(continuations)
            ]
        if task == "embed" and self.tasks.skip and any(not isinstance(x, str) for x in inputs):
            raise ConfigError(  # ids are the whole input: which of them would the prompt's be?
                "embed(): token id lists take no prompt, but this model pools without its prompt's "
                f"{self.tasks.skip} tokens (include_prompt is off); give texts, or prompt_name='' for none"
            )
        for i, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
            kw = {"continuation_ids": cont, "token_logprobs": token_logprobs} if task == "score" else {}
            self.add_request(f"{task}-{i}", prompt, adapter=names[i], **kw)
        results: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] = out
        return [results[f"{task}-{i}"] for i in range(len(inputs))]
