"""The reasoning row: a generate row whose every sample runs as two requests, its thinking and then its
answer (``job/reasoning.py`` says when: a constrained answer, or --max-reasoning-tokens).

The thinking runs unconstrained from the prompt (with the open tag) until the close tag or its token bound;
the answer from the prompt, the thinking and the close tag (added when the thinking ran long), under the row's
own parameters. A close tag of several tokens may end inside the thinking's last token: the text after it
there begins the answer's text (an error under a constraint, which can't hold it). A checkpoint saves each
sample's thinking (``answering`` names the samples whose thinking had finished): on resume every sample
re-enters as its thinking with its saved tokens, so a finished one ends at once and its answer is asked again,
seeded as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from batchjob.errors import ConfigError
from batchjob.job.reasoning import find_tags, parse_tags
from batchjob.job.rows.base import Ask, request_error
from batchjob.job.rows.generate import Samples

if TYPE_CHECKING:
    from batchjob.engine.output import RequestOutput
    from batchjob.engine.request import RequestState
    from batchjob.job.checkpoint import InFlight
    from batchjob.job.reasoning import ReasoningTags
    from batchjob.job.spec import JobSpec
    from batchjob.sampling import SamplingParams


def decode_ids(ids: list[int]) -> str:
    """Text without a tokenizer: the ids, each a word (a row built on its own, as tests do)."""
    return " ".join(str(t) for t in ids)


def think_tags(spec: JobSpec, tokenizer: Any) -> ReasoningTags | None:
    """The model's think tags (``--reasoning-tags``, else found in its tokenizer), or None; refuses
    --max-reasoning-tokens for a model without them."""
    given = parse_tags(spec.reasoning_tags) if spec.reasoning_tags else None
    tags = find_tags(tokenizer, given)
    if tags is None and spec.max_reasoning_tokens is not None:
        raise ConfigError(
            "--max-reasoning-tokens needs the model's think tags, and its tokenizer names none: give them "
            "with --reasoning-tags OPEN,CLOSE"
        )
    return tags


def answer_request_id(row_id: str, k: int) -> str:
    """The engine id of sample ``k``'s answer. It is also the answer's seeded-sampler key, so it stays what
    every earlier release used: another one would sample other answers than a job resumed from them."""
    return f"{row_id}\x1fanswer{k}"


def thinking_params(tags: ReasoningTags, params: SamplingParams, max_tokens: int | None) -> SamplingParams:
    """A row's thinking: unconstrained, until the close tag or ``max_tokens`` (--max-reasoning-tokens, else
    --max-new-tokens) tokens; its answer gets the row's own parameters after it."""
    one = len(tags.close_ids) == 1
    return params.replace(
        choices=None,
        json_schema=None,
        regex=None,
        logprobs=None,
        max_new_tokens=max_tokens or params.max_new_tokens,
        stop=None if one else [tags.close],
        stop_token_ids=list(tags.close_ids) if one else None,
    )


@dataclass(eq=False, kw_only=True)
class Reasoning(Samples):
    """A generate row in two requests a sample: ``params`` are its thinking's, ``answer_params`` its
    answer's; ``prompt_ids`` is the thinking's prompt (the row's, with the open tag)."""

    kind = "reasoning"
    tags: ReasoningTags
    answer_params: SamplingParams
    thoughts: dict[int, RequestOutput] = field(default_factory=dict)  # each sample's finished thinking
    restored_answering: list[int] = field(default_factory=list)  # the restored record's, until re-added
    decode: Callable[[list[int]], str] = decode_ids  # as the engine decodes outputs (``TokenTexts.decode``)
    # --format openai: the answer gets what the thinking left of ``answer_params.max_new_tokens`` (the body's
    # max_tokens, which counts reasoning tokens at OpenAI); else a whole max_new_tokens after it
    shared_budget: bool = False

    def finished(self, out: RequestOutput, part: int | None) -> list[Ask]:
        """A thinking that ran asks for its answer (or, having used a shared limit up, is the sample's result
        with none); an answer (or a failed thinking) is the sample's result."""
        if part is None and out.finish_reason != "error":
            ask = self._answer(out)
            if ask is not None:
                return [ask]
            return super().finished(self._no_answer(out), out.sample_index)
        return super().finished(out, part)

    def answer_room(self, thought: RequestOutput) -> int | None:
        """With a shared limit, the answer's max_new_tokens: what the thinking's tokens left of the row's (0:
        none left). None: the answer's own (a rows job's, or a label under --choices, which max_new_tokens
        never bounds). A function of the thinking's tokens alone, which a checkpoint keeps, so a resumed
        sample's answer gets what it got before."""
        if not self.shared_budget or self.answer_params.choices is not None:
            return None
        return max(self.answer_params.max_new_tokens - len(thought.token_ids), 0)

    def _answer(self, thought: RequestOutput) -> Ask | None:
        """Sample ``k``'s answer: the prompt, its thinking and the close tag (added if it ran long); None when
        the thinking used the row's shared limit up."""
        k = thought.sample_index
        self.thoughts[k] = thought
        room = self.answer_room(thought)
        if room == 0:
            return None
        thinking, close = list(thought.token_ids), list(self.tags.close_ids)
        ended = thought.finish_reason == "stop" and not thought.stopped_at_string
        if ended and thinking[-len(close) :] != close:  # the model's EOS ended it still thinking: left out
            thinking = thinking[:-1]
        ids = self.prompt_ids + thinking
        # the model wrote the tag: as the tag's own tokens, or (a tag of several tokens, ended as a stop
        # string) inside others, which a second tag after them would repeat; else it ran long: close it
        if ids[-len(close) :] != close and not thought.stopped_at_string:
            ids += close
        params = self.answer_params.replace(n=1)
        params = params if room is None else params.replace(max_new_tokens=room)
        return Ask(answer_request_id(self.row_id, k), ids, params, part=k)

    def _no_answer(self, thought: RequestOutput) -> RequestOutput:
        """The answer of a sample whose thinking used the shared limit up, as OpenAI writes it: empty, with
        finish_reason 'length'; a JSON schema or regex, which an empty answer can't match, is an error saying
        so (as the engine's ``cut_short`` says of an answer cut short by max_new_tokens)."""
        from batchjob.engine.output import RequestOutput  # (the engine's type: the engine is loaded by now)

        p, error = self.answer_params, None
        if p.constrained:
            what = "JSON schema" if p.json_schema is not None else "regex"
            error = (
                f"the answer reached its token limit (0 tokens: {self._share(thought)}) before its {what} "
                "was begun: raise max_tokens, or bound the thinking with --max-reasoning-tokens"
            )
        logprobs: list[list[tuple[int, float]]] | None = (
            [] if p.logprobs is not None and error is None else None
        )
        return RequestOutput(
            answer_request_id(self.row_id, thought.sample_index),
            list(thought.prompt_ids) + list(thought.token_ids),
            [],
            "",
            "error" if error else "length",
            error,
            thought.finish_time,
            None,
            thought.finish_time,
            logprobs=logprobs,
        )

    def _share(self, thought: RequestOutput) -> str:
        """How the shared limit was spent, for an answer's error (--format openai)."""
        return (
            f"the request's max_tokens {self.answer_params.max_new_tokens} counts the thinking's tokens and "
            f"the answer's together, and the thinking used {len(thought.token_ids)}"
        )

    def result(self, k: int, out: RequestOutput) -> dict[str, Any]:
        """The answer's text, the thinking's as ``reasoning``, and both requests' tokens."""
        error = request_error(out)
        text, reasoning, n_gen = None if error else out.text, None, len(out.token_ids)
        thought = self.thoughts.get(k)
        room = self.answer_room(thought) if error is not None and thought is not None else None
        if room and thought is not None and len(out.token_ids) >= room:  # cut short by what the thinking left
            error = f"{error} ({self._share(thought)}, leaving the answer {room})"
            out = replace(out, error=error)
        if text is not None:
            if thought is not None:
                reasoning = self.tags.split(thought.text, inside=True)[0] or ""
                n_gen += len(thought.token_ids)
                text, refused = self._after_tag(thought, out, text)
                if refused is not None:
                    out, error, text = replace(out, finish_reason="error", error=refused), refused, None
            else:
                reasoning, text = self.tags.split(text, self.inside)
        # the answer ran as sample 0 of its own request: the row's sample is k
        return self._columns(out, text, reasoning, n_gen, error, self.answer_params) | {"sample_index": k}

    def _after_tag(self, thought: RequestOutput, out: RequestOutput, text: str) -> tuple[str, str | None]:
        """The answer's text, and the row's error. A close tag of several tokens ends the thinking as a stop
        string, which may end inside a token: the text after the tag in that token (``fy``, ``ive`` for
        ``yi``: ``ve``) was written by the model and the answer was asked after it, so it begins the answer,
        as in the split of the one-request text. A constrained answer (the label, JSON or match alone) can't
        hold it: that row is an error."""
        if not thought.stopped_at_string:
            return text, None
        thinking, close = list(thought.token_ids), self.tags.close
        thought_text = self.decode(thinking)
        end = thought_text.find(close)
        if end < 0:  # (the stop string was found in the text these tokens decode to: never, unless decoding
            # changed; the answer's start is then unknown)
            return text, f"the thinking's close tag {close!r} is not in its tokens' decoded text"
        end += len(close)
        tail = thought_text[end:]
        if not tail.strip():  # whitespace (a tag's newline): the split leaves it out of the answer too
            return text, None
        if self.answer_params.constrained:
            return text, (
                f"the thinking's close tag {close!r} ended inside a token the model wrote, which goes on "
                f"with {tail!r}: the answer was asked after that text, and an answer under --choices, "
                "--json-schema or --regex can't hold it, so the row has no answer; run it unconstrained (the "
                "text then begins generated_text), or give a close tag that is one token of the tokenizer "
                "(--reasoning-tags)"
            )
        # decoded after the thinking, as the one request's text would be (a SentencePiece word-start space, a
        # character whose bytes the last thinking token began); a stop string's cut is taken off its end
        whole = self.decode(thinking + list(out.token_ids))
        if not whole.startswith(thought_text[:end]):
            return (tail + text).lstrip(), None
        cut = len(self.decode(list(out.token_ids))) - len(text) if out.stopped_at_string else 0
        return whole[end : len(whole) - cut].lstrip(), None

    def restore(self, saved: InFlight | None) -> None:
        super().restore(saved)
        if saved is not None and self.saved:
            self.restored_answering = list(saved.answering)

    def in_flight(self, states: list[tuple[int | None, RequestState]]) -> InFlight | None:
        """Each sample's thinking so far; a sample in its answer as its finished thinking (the answer is
        redone on resume)."""
        if not states:  # not yet re-added: what it restored, as it was saved
            record = super().in_flight(states)
            if record is not None:
                record.answering = list(self.restored_answering)
            return record
        prompt: list[int] | None = None
        samples: dict[int, list[int]] = {}
        answering = []
        for part, state in states:
            if part is None:
                k, ids, output = state.sample_index, state.prompt_ids, state.output_ids
            else:
                k, ids, output = part, self.prompt_ids, self.thoughts[part].token_ids
                answering.append(k)
            prompt = list(ids) if prompt is None else prompt
            samples[k] = list(output)
        assert prompt is not None
        record = self._record(prompt, samples)
        record.answering = sorted(answering)
        return record
