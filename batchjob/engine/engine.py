"""The generating core: requests in, one scheduling iteration per ``step()``, finished requests out.

``Engine.step()`` is schedule, execute, update: the scheduler's plan for one forward (running requests
first, then admissions, preempting when blocks run out; drafts proposed before it, speculative.py); the
model runner's forward, then the sampler with the request features' hooks around the draw (feature.py);
then counters, the prefix cache, each request's tokens and the stop rules (features/), and the finished
requests freed and returned (after the helper requests a feature asked for have run).

Beside it, each in its own module: the load-time plan and refusals (plan.py), admission checks (checks.py),
the request features (feature.py, features/), text and finish reasons (output.py), KV pool sizing
(kv_cache.py), CPU-only machinery (cpu/), and the prefill-only tasks, whose engine subclasses this one
through the hooks marked below (engine/tasks/). A request refused at admission finishes with an error at
the next step. The engine knows token ids, KV blocks, the model and the device, nothing about rows or jobs.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from batchjob.engine import cpu, offline, parallel, speculative, tasks, vision
from batchjob.engine import lora as lora_adapters
from batchjob.engine.block_manager import BlockManager
from batchjob.engine.checks import check_request
from batchjob.engine.config import EngineConfig
from batchjob.engine.feature import RequestFeature
from batchjob.engine.features import output_to_resume, step_features, stop_rules
from batchjob.engine.features.helpers import Helpers
from batchjob.engine.features.samples import samples
from batchjob.engine.kv_cache import allocate_kv_cache, plan_pool
from batchjob.engine.model_runner import ModelRunner
from batchjob.engine.options import EngineOptions
from batchjob.engine.output import OutputProcessor, RequestOutput
from batchjob.engine.penalties import model_penalty
from batchjob.engine.plan import ModelPlan, plan_model
from batchjob.engine.request import INTERNAL, Request, RequestState, RequestStatus
from batchjob.engine.sampler import sample
from batchjob.engine.scheduler import Scheduler, SchedulerOutput
from batchjob.engine.stats import EngineStats, eos_token_ids
from batchjob.errors import ConfigError
from batchjob.models import MADE_UP, load_model_and_tokenizer
from batchjob.sampling import SamplingParams


class Engine:
    def __init__(
        self, model, tokenizer, config: EngineConfig, model_id: str = "", *, tensor_parallel=None, lora=None
    ) -> None:
        """``tensor_parallel``: this rank's :class:`~batchjob.engine.parallel.group.Group` when ``model`` is
        its shard (``from_pretrained`` with ``tensor_parallel_size`` > 1 builds it). ``lora``: LoRA adapters
        to hold resident, name -> PEFT folder or hub id (engine/lora/)."""
        plan = plan_model(model.config, config, model, tensor_parallel is not None)  # every refusal (plan.py)
        if getattr(model, MADE_UP, None) is not None:  # weights its checkpoint lacks, made up at random
            raise getattr(model, MADE_UP)
        config.decide_step_tokens(model.config)  # the CPU's step budget, where the engine decides it
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.device = config.device
        self.dtype = config.dtype
        self.max_model_len = plan.max_model_len
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.task = config.task
        self.tasks: Any = None  # hook: a prefill-only engine's task runner (engine/tasks/)
        self.prefill_limit = self._request_limit(plan)  # hook: the longest request, in tokens
        self._build(plan, tensor_parallel)
        self._requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # rejected at admission; reported by the next step()
        penalty = model_penalty(model, config.task, model_id)
        self.features: list[RequestFeature] = step_features(  # beside the core, in hook order (features/)
            tokenizer, self.vocab_size, self.eos_token_ids, self.max_model_len, penalty
        )
        self.output = OutputProcessor(tokenizer)
        self.stop_rules = stop_rules(self)  # features/: they read its EOS ids, context and text
        self.helpers = Helpers(self._requests, self.scheduler, self._check)  # features/helpers.py
        # The resident LoRA adapters, beside the layers they target (engine/lora/).
        self.lora = lora_adapters.attach_to(self, lora, tensor_parallel is not None) if lora else None
        self.vision = vision.attach_to(self, tensor_parallel is not None)  # a VLM's images (engine/vision/)

    def _build(self, plan: ModelPlan, tensor_parallel) -> None:
        """The KV pool (planned, or sized by profiling), the block manager, model runner and scheduler."""
        config = self.config
        shape, num_blocks = plan_pool(self.model, config, self.prefill_limit, tensor_parallel)  # kv_cache.py
        # The device's hooks (engine/cpu/): on the CPU, packed weights, huge pages and the spin guard.
        self.platform = cpu.platform(config.device, spin_guard=True)
        grow = self.platform.grows_kv  # the pool takes memory as blocks are first used: reuse before growing
        self.block_manager = BlockManager(num_blocks, config.block_size, self._prefix_caching(plan), grow)
        # A token's K and V in every layer (a rank's share under tensor parallelism): the pool holds
        # num_blocks * block_size of them.
        self.kv_token_bytes = shape.bytes_per_block(1, config.dtype)
        # With graphs, one more block than the manager hands out: the padding rows' scratch space.
        scratch = num_blocks if config.cuda_graphs and self.decode_graphs else None
        blocks = num_blocks + (scratch is not None)
        kv = allocate_kv_cache(shape, blocks, config.block_size, config.dtype, config.device, self.platform)
        self.runner = ModelRunner(
            self.model,
            kv,
            config.block_size,
            config.device,
            scratch_block=scratch,
            max_graph_rows=config.max_num_batched_tokens,  # (no bucket is larger than ROW_BUCKETS[-1])
            max_model_len=self.max_model_len,
            compile_model=config.compile,
            attention_backend=config.attention_backend,
            platform=self.platform,
            tensor_parallel=tensor_parallel,
        )
        self.scheduler = self._scheduler(plan)
        self.scheduler.rope = self.runner.rope  # a longrope model's rows, each with its set (rope.py)
        self.stats = EngineStats(max_num_seqs=config.max_num_seqs, num_blocks=num_blocks)
        assert config.num_speculative_tokens is not None
        budget, seats = config.max_num_batched_tokens, config.max_num_seqs
        # Drafts could verify tokens past a longrope switch before the row is computed again (rope.py).
        drafts = 0 if self.runner.rope is not None else config.num_speculative_tokens
        self.drafter = speculative.Drafter(drafts, self.device.type, budget, seats)

    # -- hooks a prefill-only engine (engine/tasks/) overrides ----------------------------------------

    decode_graphs = True  # decode-only steps may run through CUDA graphs

    def _request_limit(self, plan: ModelPlan) -> int:
        """The longest request the engine takes, in tokens (the KV pool holds one)."""
        return plan.max_model_len

    def _prefix_caching(self, plan: ModelPlan) -> bool:
        return bool(self.config.enable_prefix_caching)

    def _scheduler(self, plan: ModelPlan) -> Scheduler:
        config = self.config
        budget, seats = config.max_num_batched_tokens, config.max_num_seqs
        return Scheduler(self.block_manager, budget, seats, static=config.static_batching)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        trust_remote_code: bool = False,
        options: EngineOptions | None = None,
        lora: lora_adapters.Paths | None = None,
        **keywords: Any,
    ) -> Engine:
        """Load a Hugging Face model (default: the embedded SmolLM2-135M-Instruct) into a new engine, of the
        class the option ``task`` picks (:meth:`engine_class`; ``"embed"`` loads the model's body,
        ``"classify"`` its sequence-classification head, the others the causal LM).

        Keywords: any of ``EngineConfig``'s (``engine/options.py`` declares each with its default and
        check; None: the engine decides), e.g. ``device="cpu"``, ``max_num_seqs=8``, ``max_model_len`` to cap
        the context, ``check_kv_pool=True`` to refuse a KV pool that cannot hold one request of it.
        ``options``: the same settings as one ``EngineOptions`` (a job's); a keyword given too wins.
        ``trust_remote_code``: run Python code shipped in the model's folder; without it such a model is
        refused (transformers is never left to ask on stdin). ``lora``: LoRA adapters held resident, name ->
        PEFT folder or hub id; a request picks one with ``add_request(..., adapter=name)``.
        """
        given = (options.as_keywords() if options is not None else {}) | keywords
        config = EngineConfig(**given)
        engine_cls = cls.engine_class(config.task)
        if lora:
            lora_adapters.refuse(config, config.tensor_parallel_size > 1)  # before any work
        if config.tensor_parallel_size > 1:
            return parallel.load_engine(engine_cls, model, config, given, trust_remote_code)
        hf_model, tokenizer, resolved = load_model_and_tokenizer(
            model, config.dtype, config.device, trust_remote_code=trust_remote_code, task=config.task
        )
        extra = {"lora": lora} if lora else {}
        return engine_cls(hf_model, tokenizer, config, model_id=resolved, **extra)

    @classmethod
    def engine_class(cls, task: str) -> type[Engine]:
        """The engine class for the option ``task``: this one generates; a prefill-only task has its own
        (the factory in engine/tasks/)."""
        return tasks.engine_class(task) or cls

    # -- the incremental API the job runner drives ---------------------------------------------------

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
        images: Any = None,
    ) -> None:
        """Queue a request. ``output_ids`` resumes one that already generated tokens in an earlier run.

        ``key`` feeds the seeded sampler; by default it is derived from ``request_id``. A request that cannot
        run (empty, too long, unknown token ids, larger than the whole KV pool) does not raise: it finishes
        with ``finish_reason="error"`` at the next step. A json_schema or regex that does not compile raises
        ``ConfigError``.

        With ``params.n > 1`` this queues the prompt's n samples (each with its own sampler key; the first
        computes the prompt and the others then take its KV blocks from the prefix cache), or only sample
        ``sample_index`` when given (to resume it).

        ``adapter``: a LoRA adapter the engine holds, by name (None: the base model; unknown: ConfigError).
        ``images``: a vision-language model's image outputs of its processor (a mapping: ``pixel_values`` and
        the family's extras, e.g. ``image_grid_thw``), or LLaVA's pixel values ``[N, C, H, W]``.
        ``continuation_ids`` and ``token_logprobs`` are a prefill-only engine's (engine/tasks/).
        """
        if continuation_ids is not None or token_logprobs:
            raise ConfigError("continuation_ids and token_logprobs are for task='score'")
        # its own copy: a caller may change theirs after adding it
        params = SamplingParams() if params is None else copy.copy(params)
        if params.seed is None and not params.greedy:
            params.seed = random.getrandbits(63)
        index = lora_adapters.index_of(self.lora, adapter)
        shown = vision.admit(self.vision, images, prompt_ids)  # its images (None: a text request)
        several = samples(request_id, params.n, key, sample_index)
        self._check_ids(request_id, [s.request_id for s in several])
        leader = None  # the first sample computes the prompt; the others wait for it (features/samples.py)
        for s in several:
            req = self._add(
                s.request_id, request_id, s.index, prompt_ids, params, output_ids, s.key, leader, index, shown
            )
            leader = leader or req

    def _check_ids(self, request_id: str, ids: list[str]) -> None:
        """Every id a request takes is free, checked before any of its samples is added (a refused request
        leaves nothing behind); ``INTERNAL`` is the engine's own."""
        if INTERNAL in request_id:
            raise ConfigError(
                f"request id {request_id!r} holds a NUL character, which the engine's own ids use"
            )
        taken = next((i for i in (request_id, *ids) if i in self._requests), None)
        if taken is not None:
            raise ConfigError(f"request id {taken!r} is already in the engine")

    def _add(
        self,
        rid: str,
        group_id: str,
        sample_index: int,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        output_ids: Sequence[int] | None,
        key: int | None,
        wait_for: Request | None,
        adapter: int = 0,
        images: vision.Images | None = None,
    ) -> Request:
        prompt = offline.token_ids(prompt_ids, f"request {rid!r}'s prompt")
        output = offline.token_ids(output_ids, f"request {rid!r}'s output") if output_ids else []
        req = Request(rid, prompt + output, len(prompt), params, time.monotonic(), group_id=group_id)
        req.sample_index, req.adapter, req.images = sample_index, adapter, images
        if key is not None:
            req.key = key
        for feature in self.features:
            feature.admit(req)
        self._requests[rid] = req
        self.stats.prompt_tokens += len(prompt)
        error = self._check(req)
        if error is None and req.num_output_tokens:
            for feature in self.features:
                error = error or feature.replay(req)
        if error is not None:
            req.error = error
            self._failed.append(req)
        elif req.num_output_tokens and self._stop_status(req, req.token_ids[-1]) is not None:
            self._failed.append(req)  # already complete: report it as finished at the next step
        else:
            req.wait_for = wait_for
            self.scheduler.add(req)
        return req

    def _check(self, req: Request) -> str | None:
        """Why a new request cannot run (its error), or None (checks.py)."""
        return check_request(req, self.max_model_len, self.vocab_size, self.block_manager, self.stop_rules)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def snapshot(self) -> list[RequestState]:
        """Every unfinished request (a finished one still waiting for its helpers included)."""
        states = []
        for r in self._requests.values():
            if r.owner is not None or (r.is_finished and not r.pending_helpers):
                continue
            states.append(self._state_of(r))
        return states

    def _state_of(self, r: Request) -> RequestState:
        """What a checkpoint keeps of an unfinished request (a hook: engine/tasks/ has its own)."""
        output = output_to_resume(r)
        adapter = None if self.lora is None else self.lora.name(r.adapter)
        return RequestState(r.group_id, r.prompt_ids, output, r.params, r.sample_index, adapter=adapter)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if it has any (at exit this happens by itself);
        the engine cannot step afterwards. Nothing to do for a single-process engine."""
        if self.runner.tensor_parallel is not None:
            self.runner.tensor_parallel.close()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes, so the next requests compute every token (e.g. to time a
        workload a second time). Only on an idle engine."""
        if self.has_unfinished():
            raise ConfigError("reset_prefix_cache() needs an idle engine; it has unfinished requests")
        self.block_manager.reset_prefix_cache()

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` (all its samples, and their helper requests) without an output."""
        for rid, req in list(self._requests.items()):
            owner = req.owner or req
            if owner.group_id != request_id:
                continue
            del self._requests[rid]
            if req in self._failed:
                self._failed.remove(req)
            elif not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)

    def step(self) -> list[RequestOutput]:
        """Schedule, execute one forward, update. Returns the requests that finished in this step."""
        t0 = time.perf_counter()
        self.stats.short_spin_steps += self.platform.before_step()
        finished = self._flush_failed()
        plan = self._schedule()
        if not plan.is_empty:
            rows = self.drafter.rows(plan)
            finished += self._update(plan, *self._execute(plan))
            self.drafter.observe(*rows, time.perf_counter() - t0)
        outputs = self._collect(finished)
        self.stats.step_seconds += time.perf_counter() - t0
        return outputs

    # -- the three parts of a step -------------------------------------------------------------------

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan for one forward; the running requests that can draft propose their next
        tokens first (speculative.py), and keep the drafts the plan has room for."""
        plan = self.drafter.schedule(self.scheduler, self.block_manager, self.max_model_len)
        self.stats.preemptions += len(plan.preempted)
        self.stats.cached_prompt_tokens = self.scheduler.num_cached_tokens
        return plan

    def _execute(self, plan: SchedulerOutput) -> tuple[list[Request], list[list[int]]]:
        """One forward of the plan, then the sampler. Returns the requests that sampled and the tokens each
        drew: one, or with d drafts one at each of its d + 1 positions."""
        will_sample = [
            r
            for r, n in zip(plan.requests, plan.num_tokens, strict=True)
            if r.num_computed_tokens + n == r.num_tokens
        ]
        for feature in self.features:
            feature.before_forward(will_sample)
        logits, sampling = self.runner.execute(plan)
        if not sampling:
            return [], []
        rows, positions = speculative.sampled_rows(sampling)
        return sampling, speculative.per_request(self._sample(logits, rows, positions), sampling)

    def _update(
        self, plan: SchedulerOutput, sampling: list[Request], drawn: list[list[int]]
    ) -> list[Request]:
        """Advance the counters, give each request its tokens, take out the ones that finished. Returns
        those that can be reported now."""
        self._advance(plan)
        finished: list[Request] = []
        now = time.monotonic()
        for req, tokens in zip(sampling, drawn, strict=True):
            if req.owner is not None:
                self.helpers.finish(req, finished)
                continue
            status = self._take_tokens(req, tokens, now)
            if status is not None:
                self.scheduler.finish(req, status)
                if self._ready(req):
                    finished.append(req)
        self._count(plan)
        return finished

    def _advance(self, plan: SchedulerOutput) -> None:
        """Each request's counter past the tokens this step computed (full blocks into the prefix cache)."""
        for req, n in zip(plan.requests, plan.num_tokens, strict=True):
            self.stats.computed_prompt_tokens += max(
                0, min(req.num_prompt_tokens - req.num_computed_tokens, n)
            )
            req.num_computed_tokens += n
            if not req.num_draft_tokens:  # a verified draft registers once its kept tokens are known
                self.block_manager.register_full_blocks(req)

    def _count(self, plan: SchedulerOutput) -> None:
        self.stats.count_step(plan, self.block_manager.num_used_blocks, self.runner.forward_seconds)

    # -- around the step ------------------------------------------------------------------------------

    def _flush_failed(self) -> list[Request]:
        """The requests refused at admission (or resumed already complete), finished."""
        finished = []
        for req in self._failed:
            status = RequestStatus.FINISHED_ERROR if req.error else self._stop_status(req, req.token_ids[-1])
            req.status = status or RequestStatus.FINISHED_LENGTH
            if self._ready(req):
                finished.append(req)
        self._failed.clear()
        return finished

    def _collect(self, finished: list[Request]) -> list[RequestOutput]:
        outputs = [self.output.output(req) for req in finished]
        for req in finished:
            del self._requests[req.request_id]
        if not self._requests:
            self.platform.idle()
        return outputs

    def _take_tokens(self, req: Request, drawn: list[int], now: float) -> RequestStatus | None:
        """Append the tokens a request drew (with drafts, those the drafter keeps: speculative.py). Returns
        the request's finished status, if it finished."""

        def take(tok: int) -> RequestStatus | None:
            req.token_ids.append(tok)
            self.stats.generated_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            return RequestStatus.FINISHED_ERROR if req.error else self._stop_status(req, tok)

        if not req.num_draft_tokens:
            (tok,) = drawn  # one draw: its next token
            return take(tok)
        return self.drafter.verify(req, drawn, take, self.stats, self.block_manager)

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        """The first verdict of the stop rules (features/): a finished status, or None to go on."""
        for rule in self.stop_rules:
            status = rule.stop(req, tok)
            if status is not None:
                return status if status.is_finished else None
        return None

    # -- the request features' hooks (feature.py) ------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[Request], positions: list[int]) -> list[int]:
        """The features see the model's own distribution, then mask it; draw; the features see the draw
        (and may replace it: a resumed request's replayed tokens)."""
        features = self.features
        for feature in features:
            feature.see_logits(rows, logits)
        for feature in features:
            logits = feature.mask(rows, logits)
        tokens = sample(logits, [r.params for r in rows], [r.key for r in rows], positions)
        for feature in features:
            feature.after_sample(rows, tokens)
        return tokens

    def _ready(self, req: Request) -> bool:
        """Whether a finished request can be reported now (after the helpers its features ask for)."""
        return self.helpers.ready(req, self.features)

    # -- convenience ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (raw text, or token ids) to completion; outputs in input order (a prompt's n
        samples in a row). An instruct model's questions go through :meth:`chat` (offline.py). ``adapters``:
        each prompt's LoRA adapter name (None: the base model), as ``add_request`` takes it."""
        prompts = offline.prompt_list(prompts, "generate")
        names = lora_adapters.per_prompt(self.lora, adapters, len(prompts))
        return offline.generate(self, prompts, offline.params_for(prompts, sampling_params), names)

    def chat(
        self,
        conversations: Sequence[str] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[str | None] | None = None,
        *,
        system: str | None = None,
    ) -> list[RequestOutput]:
        """:meth:`generate` (``adapters`` too) over each conversation (a user message, or a list of
        ``{role, content}`` messages) put through the tokenizer's chat template, as ``batchjob run`` does."""
        conversations = offline.prompt_list(conversations, "chat")
        params = offline.params_for(conversations, sampling_params)
        names = lora_adapters.per_prompt(self.lora, adapters, len(conversations))
        prompts = offline.chat_prompts(self.tokenizer, conversations, system)
        return offline.generate(self, prompts, params, names)

    def tokenize(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """A text's token ids, with the tokenizer's special tokens (a prefill-only engine cuts them)."""
        tokenizer = self.tokenizer
        return tokenizer(text, add_special_tokens=special_tokens, truncation=False, max_length=None).input_ids
