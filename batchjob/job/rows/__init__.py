"""What a row becomes: each row of a job is built into its row kind, which says what requests it makes and
what their outputs turn into (``base.py``). The kinds: ``generate.py`` (a prompt sampled ``--n`` times),
``reasoning.py`` (its thinking and its answer as two requests a sample), ``task.py`` (one prefill-only
request), ``embeddings.py`` (an OpenAI embeddings request line, a request per input).

``RowMaker`` chooses and builds a row's kind from the job's options, or says why the row is an error row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchjob.job import model_identity
from batchjob.job.requests import parse_embeddings_request
from batchjob.job.rows.adapter import row_adapter
from batchjob.job.rows.base import RowWork
from batchjob.job.rows.embeddings import EmbeddingInputs
from batchjob.job.rows.generate import Samples
from batchjob.job.rows.images import image_request
from batchjob.job.rows.prompt import row_request
from batchjob.job.rows.reasoning import Reasoning, thinking_params
from batchjob.job.rows.task import TaskRow
from batchjob.job.rows.token_texts import TokenTexts

if TYPE_CHECKING:
    from batchjob.io.readers import Row
    from batchjob.job.prompts import PromptBuilder
    from batchjob.job.reasoning import ReasoningTags
    from batchjob.job.rows.images import ImagePrompt, ImagePrompts
    from batchjob.job.seam import JobEngine
    from batchjob.job.spec import JobSpec
    from batchjob.sampling import SamplingParams

Made = tuple[RowWork | None, str | None]  # the row's kind, or None and the row's error
# an image row's parameters and prompt, or None and its error (``RowMaker.image_prompt``)
Built = tuple["SamplingParams | None", "ImagePrompt | None", str | None]


class RowMaker:
    """Builds each row of one job into its kind: the job's options, the engine's tokenizer, the model's
    think tags; and what ``body.model`` the requests named (--format openai)."""

    def __init__(
        self,
        spec: JobSpec,
        engine: JobEngine,
        builder: PromptBuilder,
        params: SamplingParams,
        tags: ReasoningTags | None,
        width: int,
        images: ImagePrompts | None = None,
    ) -> None:
        """``params``: what rows leave out; ``width``: --task embed's only ``body.dimensions`` value;
        ``images``: --image-column's prompts (rows/images.py)."""
        self.spec = spec
        self.engine = engine
        self.builder = builder
        self.params = params
        self.tags = tags
        self.width = width
        self.images = images
        self.task = spec.engine.task  # generate, or a prefill-only task: which kinds the rows are
        # --format openai: what body.model may say (the model's names, or a --lora adapter's)
        self.model_names = model_identity.model_names(spec.model) | set(spec.lora_paths)
        self.models_seen: set[str] = set()
        # --logprobs: each token's text as it stands in the output's text (token_texts.py)
        self.texts = TokenTexts(engine.tokenizer)

    def make(self, row: Row, row_id: str, built: Built | None = None) -> Made:
        """The row (readable, with its id) as its kind, or the reason it is an error row; ``built``: an
        image row's ``image_prompt``, made ahead on a worker thread (``job/ahead.py``)."""
        if self.task != "generate":
            return self._task_row(row, row_id)
        if self.images is not None:
            built = built if built is not None else self.image_prompt(row, self.images)
            return self._image_row(row, row_id, built)
        params, ids, error = self._request(row)
        if ids is None or params is None:
            return None, error
        adapter, error = row_adapter(self.spec, row)
        if error is not None:
            return None, error
        work = self._generate_row(row, row_id, ids, params)
        work.adapter = adapter
        return work, None

    def image_prompt(self, row: Row, images: ImagePrompts) -> Built:
        """An image row's parameters (a params column's, an OpenAI request's) and its prompt from the
        processor, its images decoded; or its error: a function of the row alone, safe on a worker thread
        with its own ``images`` (``ImagePrompts.copy``)."""
        assert row.values is not None
        check = self.model_names if self.spec.format == "openai" and self.spec.check_model_name else None
        return image_request(self.spec, images, self.params, row, check)

    def _image_row(self, row: Row, row_id: str, built: Built) -> Made:
        """A generate row with images (--image-column, or OpenAI image parts): its ``image_prompt``."""
        if self.spec.format == "openai":
            self._saw_model(row)
        params, prompt, error = built
        if prompt is None or params is None:
            return None, error
        adapter, error = row_adapter(self.spec, row)
        if error is not None:
            return None, error
        work = self._generate_row(row, row_id, prompt.ids, params)
        work.adapter, work.images, work.num_images = adapter, prompt.images, prompt.count
        return work, None

    def _generate_row(self, row: Row, row_id: str, ids: list[int], params: SamplingParams) -> Samples:
        """A generate row; in two requests a sample when the model thinks before a constrained or bounded
        answer, unless the chat template turned its thinking off (an OpenAI request's two within its
        max_tokens)."""
        tags, inside, spec = self.tags, False, self.spec
        # --format openai: the thinking and the answer share the body's max_tokens, as OpenAI counts reasoning
        # tokens inside max_tokens/max_completion_tokens (a rows job's answer gets --max-new-tokens after it)
        shared = spec.format == "openai"
        if tags is not None:
            opened = tags.opened(ids, self._decode)
            inside = opened is True
            if opened is not False and (params.constrained or spec.max_reasoning_tokens is not None):
                prompt = ids if inside else ids + list(tags.open_ids)
                # the thinking leaves the context room for the close tag and the answer (its max_new_tokens),
                # or every long thought's answer would be refused as a prompt too long for the context
                room = self.engine.max_model_len - len(prompt) - len(tags.close_ids) - params.max_new_tokens
                thinking = min(spec.max_reasoning_tokens or params.max_new_tokens, max(room, 1))
                if shared:  # the thinking's tokens count in the body's max_tokens: it can't run past them
                    thinking = min(thinking, params.max_new_tokens)
                return Reasoning(
                    row=row,
                    row_id=row_id,
                    prompt_ids=prompt,
                    num_prompt_tokens=len(ids),
                    params=thinking_params(tags, params, thinking),
                    answer_params=params,
                    tags=tags,
                    inside=inside,
                    spell=self.texts.spell,
                    decode=self.texts.decode,
                    every=spec.per_row_params,
                    shared_budget=shared,
                )
        return Samples(
            row=row,
            row_id=row_id,
            prompt_ids=ids,
            num_prompt_tokens=len(ids),
            params=params,
            tags=tags,
            inside=inside,
            spell=self.texts.spell,
            every=spec.per_row_params,
        )

    def _decode(self, ids: list[int]) -> str:
        return str(self.engine.tokenizer.decode(ids))

    def _task_row(self, row: Row, row_id: str) -> Made:
        """A prefill-only row: an OpenAI embeddings request line's inputs, or one request (--task score:
        with the scored text)."""
        inputs = None
        params: SamplingParams | None
        ids: list[int] | None
        if self.spec.format == "openai":  # /v1/embeddings request lines
            inputs, error = self._embedding_inputs(row)
            if inputs is None:
                return None, error
            params, ids = self.params, inputs[0]
        else:
            params, ids, error = self._request(row)
        if ids is None or params is None:
            return None, error
        adapter, error = row_adapter(self.spec, row)
        if error is not None:
            return None, error
        n_prompt = len(ids) if inputs is None else sum(len(x) for x in inputs)
        continuation = None
        if self.spec.score_column is not None:
            continuation, error = self._continuation(row)
            if continuation is None:
                return None, error
            n_prompt += len(continuation)
            if self.spec.engine.truncate:  # the engine cuts the text (prompt and scored text) to its limit
                n_prompt = min(n_prompt, self.engine.prefill_limit)
        task = self.task
        if inputs is not None:
            return EmbeddingInputs(
                row=row,
                row_id=row_id,
                prompt_ids=ids,
                num_prompt_tokens=n_prompt,
                task=task,
                inputs=inputs,
                adapter=adapter,
            ), None
        token_logprobs = self.spec.logprobs is not None
        return TaskRow(
            row=row,
            row_id=row_id,
            prompt_ids=ids,
            num_prompt_tokens=n_prompt,
            task=task,
            continuation=continuation,
            token_logprobs=token_logprobs,
            adapter=adapter,
        ), None

    def _request(self, row: Row) -> tuple[SamplingParams | None, list[int] | None, str | None]:
        """A row's sampling parameters and prompt ids, or the reason it has none (naming line and field)."""
        self._saw_model(row)
        check = self.model_names if self.spec.check_model_name else None
        return row_request(self.spec, self.builder, self.params, row, check)

    def _saw_model(self, row: Row) -> None:
        """--format openai: note the ``body.model`` a request names (the run says which it ignored)."""
        if self.spec.format == "openai" and row.values is not None:
            body = row.values.get("body")
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                self.models_seen.add(body["model"])

    def _embedding_inputs(self, row: Row) -> tuple[list[list[int]] | None, str | None]:
        """--task embed --format openai: the token ids of each of the request's inputs, or its error."""
        assert row.values is not None
        self._saw_model(row)
        where = f"{row.source} line {row.line}: " if row.line is not None else ""
        check = self.model_names if self.spec.check_model_name else None
        texts, error = parse_embeddings_request(row.values, check, self.width)
        if texts is None:
            return None, where + str(error)
        inputs = []
        for k, text in enumerate(texts):
            ids, error = self.builder.build_request({"prompt": text})
            if ids is None:
                return None, f"{where}body.input[{k}]: {error}"
            inputs.append(ids)
        return inputs, None

    def _continuation(self, row: Row) -> tuple[list[int] | None, str | None]:
        """--score-column: the scored text's token ids (as ``Engine.score`` tokenizes a continuation), or
        why the row has none."""
        assert row.values is not None
        col = self.spec.score_column
        assert col is not None
        value = row.values.get(col)
        where = f"{row.source} line {row.line}: " if row.line is not None else ""
        if value is None:
            return None, f"{where}score column {col!r} is null or missing"
        if not isinstance(value, str):
            return None, f"{where}score column {col!r} is not text (got {type(value).__name__})"
        # uncut, as Engine.score's scored_ids: the engine cuts prompt and scored text together, from the end
        # (cut alone on a tokenizer's truncation_side "left", the text lost its start: a middle piece was scored)
        ids = (
            self.engine.tokenizer(value, add_special_tokens=False, truncation=False).input_ids
            if value
            else []
        )
        if not ids:
            return None, f"{where}score column {col!r} is empty: there is nothing to score"
        return list(ids), None
