"""Whole batches from Python: prompts in, every output back in input order (``Engine.generate`` and
``Engine.chat``). The loop is the incremental API's (add_request, then step until idle); nothing here is
on the step's path.

A plain string is raw text to ``generate``, as in Hugging Face ``generate`` and vLLM's ``LLM.generate``: an
instruct model given a bare question may answer with nothing. ``chat`` renders each prompt through the
tokenizer's chat template first, as ``batchjob run`` does by default.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from batchjob.engine.output import RequestOutput
from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams

Message = dict[str, str]  # {"role": ..., "content": ...}


class _Engine(Protocol):  # what the loop uses of the engine (engine.py imports this module)
    tokenizer: Any

    def has_unfinished(self) -> bool: ...

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = ...,
        *,
        key: int | None,
        adapter: str | None,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...


def prompt_list(prompts: Any, what: str, noun: str = "prompt") -> list[Any]:
    """The prompts of ``generate``/``chat`` (and the inputs of the tasks' ``embed``/``classify``/``score``,
    ``what`` naming the call): a list (one text, or one conversation's messages, is one prompt, as vLLM takes
    it; a string was read as a prompt per character). ``noun``: what one item is, for the message."""
    if isinstance(prompts, str) or (what == "chat" and prompts and isinstance(prompts[0], dict)):
        return [prompts]
    if isinstance(prompts, (Mapping, bytes, bytearray)) or not hasattr(prompts, "__len__"):
        raise ConfigError(f"{what}() takes a list of {noun}s, got {type(prompts).__name__}")
    bare = next((p for p in prompts if isinstance(p, int) or getattr(p, "ndim", None) == 0), None)
    if bare is not None:
        raise ConfigError(
            f"{what}() takes a list of {noun}s, each a text or a list of token ids; got the integer {bare!r} "
            f"as {'an' if noun[0] in 'aeiou' else 'a'} {noun} (one {noun}'s ids go in a list of their own: "
            "[[ids...]])"
        )
    return list(prompts)


def params_for(
    prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    """One sampling params per prompt."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ConfigError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    return params


def token_ids(values: Any, what: str) -> list[int]:
    """``values`` as a list of token ids: ints (numpy's and torch's integers too); a float, a boolean or a
    string is refused, not converted (``int(1.5)`` would quietly be 1, ``True`` 1), and so is what is no list
    of them (bytes would be read as their byte values, a dict as its keys)."""
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not hasattr(values, "__iter__"):
        raise ConfigError(f"{what} is {type(values).__name__}, not a list of token ids")
    values = list(values)
    for k, t in enumerate(values):  # the first that is no integer, for the message
        if type(t) is not int and not _integer(t):
            raise ConfigError(f"{what}: token {k} is {t!r} ({type(t).__name__}), not an integer token id")
    return list(map(operator.index, values))


def _integer(value: Any) -> bool:
    """Whether ``value`` is an integer (numpy's and torch's too) that is no boolean."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _text(text: str, what: str) -> str:
    """``text``, refused where a tokenizer could not take it: a lone surrogate (half a UTF-16 pair)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{what}: character {e.start} ({ascii(text[e.start])[1:-1]}) is half a UTF-16 pair, not a character"
        ) from None
    return text


def prompt_ids(prompt: Any, what: str, tokenize: Callable[[str], list[int]]) -> list[int]:
    """One prompt's token ids, by the one rule of ``generate`` and the tasks' calls: a text through
    ``tokenize`` (refused where a tokenizer could not take it), a list of token ids (``token_ids``); anything
    else is refused, naming ``what`` (the prompt's index)."""
    if isinstance(prompt, str):
        return list(tokenize(_text(prompt, what)))
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not hasattr(prompt, "__iter__"):
        raise ConfigError(f"{what} is {type(prompt).__name__}: give a text or a list of token ids")
    return token_ids(prompt, what)


def generate(
    engine: _Engine,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    params: list[SamplingParams],
    adapters: Sequence[str | None] | None = None,
) -> list[RequestOutput]:
    """Run every prompt (text, or token ids) to completion on an idle engine; a prompt's n samples in a row,
    each under its adapter in ``adapters`` (None or a None name: the base model).
    A request's draws are keyed by its prompt, so a seeded one samples the same tokens alone or in a crowd."""
    if engine.has_unfinished():
        raise ConfigError("generate() needs an idle engine; it has unfinished requests")
    ids = []
    names = adapters if adapters is not None else [None] * len(prompts)
    tokenizer = engine.tokenizer
    all_ids = [  # all of them checked before any is added: a refused batch leaves the engine idle
        prompt_ids(prompt, f"prompt {i}", lambda text: tokenizer(text).input_ids)
        for i, prompt in enumerate(prompts)
    ]
    for i, (tokens, p) in enumerate(zip(all_ids, params, strict=True)):
        digest = hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest()
        rid = f"generate-{i}"
        key = int.from_bytes(digest, "little") & 0x7FFFFFFF
        engine.add_request(rid, tokens, p, key=key, adapter=names[i])
        ids.append(rid)
    results: dict[tuple[str, int | None], RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id, out.sample_index] = out
    return [results[rid, k] for rid, p in zip(ids, params, strict=True) for k in range(p.n)]


def chat_prompts(
    tokenizer: Any, conversations: Sequence[str] | Sequence[list[Message]], system: str | None
) -> list[list[int]]:
    """Each conversation (a user message's text, or a list of messages) as the token ids of the chat
    template with the assistant's turn opened; ``system`` goes first where a conversation has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "chat() needs a tokenizer with a chat template; this one has none: use generate() with the "
            "prompt text as the model expects it"
        )
    rendered = []
    for i, c in enumerate(conversations):
        if isinstance(c, str):
            messages = [{"role": "user", "content": _text(c, f"conversation {i}")}]
        elif isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c):
            messages = list(c)
            for j, m in enumerate(messages):
                if isinstance(m.get("content"), str):
                    _text(m["content"], f"conversation {i}, message {j}")
        else:
            raise ConfigError(
                f"conversation {i} is {type(c).__name__}: give a string (the user's message) or a list of "
                "{role, content} messages"
            )
        if system is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # the template writes the special tokens itself, so they are not added again
        rendered.append(tokenizer(text, add_special_tokens=False).input_ids)
    return rendered
