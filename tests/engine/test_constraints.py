"""Constrained decoding on a tiny random model whose free answers are garbage: every constrained answer is
valid, choice and token log-probabilities agree with the model's own logits, constrained rows are exact under
preemption and resume, and a prompt's n samples compute its KV once."""

from __future__ import annotations

import json
import math
import random
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from batchjob.engine.constraints import ChoiceTrie
from batchjob.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

# "neutral" ends where "neutrality" goes on, "negative" shares a first token with both, "pos" is a prefix of
# "positive": the trie has inner nodes off any one decoded path, so the scoring requests run.
CHOICES = ["positive", "pos", "negative", "neutral", "neutrality", "not sure"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "label": {"enum": ["good", "bad", "unclear"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "label", "tags", "ok", "where"],
    "additionalProperties": False,
}
SMALL_SCHEMA = {  # short answers, for the tests that run many engines
    "type": "object",
    "properties": {"label": {"enum": ["good", "bad"]}, "name": {"type": "string", "maxLength": 4}},
    "required": ["label", "name"],
}
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2,3}"


def _engine(folder, dtype="float64", **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine.from_pretrained(str(folder), dtype=dtype, device="cpu", **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def engine32(tiny_model_dir):
    return _engine(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row i is log P(next token | tokens[: i + 1])."""
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].log_softmax(-1)


def test_the_trie_has_inner_nodes_off_any_single_path(engine):
    ids = [engine.tokenizer(c, add_special_tokens=False).input_ids for c in CHOICES]
    trie = ChoiceTrie(CHOICES, ids)
    assert any(len(t) > 1 for t in ids)
    assert len(trie.inner_nodes) >= 4
    assert any(ids[i] == ids[j][: len(ids[i])] for i in range(len(ids)) for j in range(len(ids)) if i != j)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choices_are_always_exactly_one_label(engine32, temperature):
    engine = engine32
    prompts = _prompts(24, engine.vocab_size, seed=1)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=temperature, seed=5))
    assert not any(o.text in CHOICES for o in free)  # the model left free answers garbage
    outs = engine.generate(prompts, SamplingParams(choices=CHOICES, temperature=temperature, seed=5))
    for o in outs:
        assert o.text in CHOICES, o.text
        assert o.finish_reason == "stop"
        assert o.token_ids == engine.tokenizer(o.text, add_special_tokens=False).input_ids
        assert set(o.choice_logprobs) == set(CHOICES)
        assert all(v < 0 and math.isfinite(v) for v in o.choice_logprobs.values())
        if temperature == 0.0:  # greedy answers the most likely whole label
            assert o.text == max(o.choice_logprobs, key=o.choice_logprobs.get)
    if temperature > 0:
        assert len({o.text for o in outs}) > 1


def test_choice_logprobs_agree_with_the_models_logits(engine, hf):
    prompts = _prompts(5, engine.vocab_size, seed=2)
    outs = engine.generate(prompts, SamplingParams(choices=CHOICES, seed=3))
    ids = [engine.tokenizer(c, add_special_tokens=False).input_ids for c in CHOICES]
    for prompt, o in zip(prompts, outs, strict=True):
        for choice in CHOICES:
            toks = engine.tokenizer(choice, add_special_tokens=False).input_ids
            lp = _hf_logprobs(hf, prompt + toks)
            want = sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks))
            # a choice longer ones go on from: where the model does not go on into them
            on = {c[len(toks)] for c in ids if len(c) > len(toks) and c[: len(toks)] == toks}
            want += math.log1p(-sum(lp[-1, t].exp().item() for t in on)) if on else 0.0
            assert o.choice_logprobs[choice] == pytest.approx(want, abs=1e-8), choice
        total = sum(math.exp(v) for v in o.choice_logprobs.values())  # renormalised over the choices
        assert o.choice_probs == pytest.approx({k: math.exp(v) / total for k, v in o.choice_logprobs.items()})
        assert sum(o.choice_probs.values()) == pytest.approx(1.0, abs=1e-12)


def test_json_schema_answers_always_validate(engine32):
    engine = engine32
    prompts = _prompts(10, engine.vocab_size, seed=4)
    outs = engine.generate(prompts, SamplingParams(json_schema=SCHEMA, max_new_tokens=160, seed=7))
    for o in outs:  # (length: closed by the engine near its token limit)
        assert o.finish_reason in ("stop", "length") and o.error is None, o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    greedy = engine.generate(
        prompts[:3], SamplingParams(json_schema=json.dumps(SCHEMA), max_new_tokens=160, temperature=0)
    )
    for o in greedy:
        jsonschema.validate(json.loads(o.text), SCHEMA)


UNBOUNDED = {  # strings and numbers a random model never closes on its own
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]},
    },
    "required": ["name", "score", "tags", "meta"],
}


@pytest.mark.parametrize("max_new_tokens", [8, 120])
def test_json_answers_close_within_the_token_budget(engine32, max_new_tokens):
    """Near the end of its budget a row closes its strings, numbers and brackets instead of running out."""
    prompts = _prompts(12, engine32.vocab_size, seed=11)
    names = []
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            json_schema=UNBOUNDED, max_new_tokens=max_new_tokens, temperature=temperature, seed=3
        )
        for o in engine32.generate(prompts, params):
            assert len(o.token_ids) <= max_new_tokens
            if max_new_tokens >= 120:  # a random model's strings are closed by the engine: length, said so
                assert o.finish_reason in ("stop", "length") and o.error is None, o.text
                answer = json.loads(o.text)
                jsonschema.validate(answer, UNBOUNDED)
                assert set(answer) == set(UNBOUNDED["properties"])  # no keys of the model's own
                names.append(answer["name"])
    if max_new_tokens >= 120:  # the budget was spent on the answer, not closed from the start
        assert sum(len(n) for n in names) > 10 * len(prompts)


def test_json_answers_close_before_the_context_ends(tiny_model_dir):
    """Where the context ends before max_new_tokens, a JSON answer is steered to close before the context's
    end: each row (sampled n times too, and resumed) is the answer it gets with max_new_tokens set to the
    room its prompt leaves, valid. (Steered by max_new_tokens alone, every row here was an error, cut by the
    context at 149 to 157 tokens.)"""
    engine = _engine(tiny_model_dir, "float32", max_model_len=160)
    prompts = _prompts(6, engine.vocab_size, seed=11)

    def params(max_new_tokens: list[int]) -> list[SamplingParams]:
        return [
            SamplingParams(json_schema=UNBOUNDED, max_new_tokens=m, temperature=t, seed=3, n=1 + (t > 0))
            for m, t in zip(max_new_tokens, [0.0, 1.0] * 3, strict=True)
        ]

    long = params([1000] * len(prompts))
    got = _run(engine, prompts, long)
    want = _run(engine, prompts, params([160 - len(p) for p in prompts]))
    assert sorted(got) == sorted(want) and len(got) == 9
    for k, o in got.items():
        _same(o, want[k])
        assert o.finish_reason in ("stop", "length") and o.error is None, o.text
        jsonschema.validate(json.loads(o.text), UNBOUNDED)
    _run(engine, prompts, long, stop_after=90)  # resumed while steered: its room is the prompt's alone
    states = engine.snapshot()
    assert states and all(st.output_ids for st in states)
    for i in range(len(prompts)):
        engine.abort(f"row-{i}")
    for st in states:
        engine.add_request(
            st.request_id, st.prompt_ids, st.params, st.output_ids, sample_index=st.sample_index
        )
    for k, o in _run(engine, [], []).items():
        _same(o, got[k])


def test_regex_answers_match(engine32):
    engine = engine32
    prompts = _prompts(8, engine.vocab_size, seed=5)
    for o in engine.generate(prompts, SamplingParams(regex=REGEX, max_new_tokens=40, seed=2)):
        assert re.fullmatch(REGEX, o.text), o.text
        assert o.finish_reason == "stop"


def test_an_answer_cut_by_its_token_limit_before_the_grammar_completes_is_an_error(engine32):
    """`{"label"` at max_new_tokens is no answer: an error naming the limit, not a finish by length."""
    prompts = _prompts(4, engine32.vocab_size, seed=6)
    for params, what in (
        (SamplingParams(json_schema=SMALL_SCHEMA, max_new_tokens=2, temperature=0), "JSON schema"),
        (SamplingParams(regex=REGEX, max_new_tokens=1, seed=4), "regex"),
    ):
        for o in engine32.generate(prompts, params):
            assert o.finish_reason == "error", o.text
            assert o.error.startswith("the answer reached its token limit (") and what in o.error
            assert "raise max_new_tokens" in o.error
    # free text cut by its limit is the model's (finish "length"), as before
    free = engine32.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
    assert {(o.finish_reason, o.error) for o in free} == {("length", None)}


def test_a_choice_the_context_ends_inside_is_an_error(tiny_model_dir):
    """A choice is written whole: where the context ends first, 'alp' of 'alpha beta gamma' is no answer."""
    engine = _engine(tiny_model_dir, "float32", max_model_len=40)
    prompt = [5 + i % 50 for i in range(38)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            choices=["alpha beta gamma", "delta epsilon zeta"], temperature=temperature, seed=1
        )
        [o] = engine.generate([prompt], params)
        assert o.finish_reason == "error" and o.error.startswith(
            "the context ended (40 tokens) before a choice"
        )


def test_an_answer_the_context_cuts_is_an_error_naming_the_context(tiny_model_dir):
    """Where the context, not max_new_tokens, cut the answer, the error says so and how to go on (it said
    'raise max_new_tokens', which would change nothing); where both ended at once, it names both."""
    engine = _engine(tiny_model_dir, "float32", max_model_len=24)
    for params, room, what in (
        (SamplingParams(json_schema=SMALL_SCHEMA, max_new_tokens=40, temperature=0), 2, "JSON schema"),
        (SamplingParams(regex=REGEX, max_new_tokens=40, seed=4), 1, "regex"),
    ):
        prompt = [5 + i % 50 for i in range(24 - room)]
        [o] = engine.generate([prompt], params)
        assert o.finish_reason == "error" and len(o.token_ids) == room, o.text
        assert o.error == (
            f"the context ended (24 tokens: {24 - room} before the answer, {room} of it) before its {what} was "
            "complete: shorten the prompt or raise --max-model-len"
        )
        params.max_new_tokens = room  # both limits at once: raising either alone would not do
        [o] = engine.generate([prompt], params)
        assert o.finish_reason == "error" and o.error.startswith(
            f"the answer reached its token limit ({room} tokens, max_new_tokens {room}) as the context ended"
        )
        assert o.error.endswith("raise max_new_tokens, and shorten the prompt or raise --max-model-len")


def test_bad_schema_or_regex_is_a_config_error(engine):
    with pytest.raises(ConfigError, match="json_schema"):
        engine.add_request("bad-schema", [5, 6, 7], SamplingParams(json_schema={"type": "no-such-type"}))
    with pytest.raises(ConfigError, match="regex"):
        engine.add_request("bad-regex", [5, 6, 7], SamplingParams(regex="(unclosed"))
    assert not engine.has_unfinished()


def test_logprobs_agree_with_the_models_logits(engine, hf):
    prompts = _prompts(3, engine.vocab_size, seed=6)
    outs = engine.generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0, logprobs=5, ignore_eos=True)
    )
    for prompt, o in zip(prompts, outs, strict=True):
        lp = _hf_logprobs(hf, prompt + o.token_ids)
        assert len(o.logprobs) == len(o.token_ids)
        for i, (tok, top) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            row = lp[len(prompt) - 1 + i]
            values, ids = row.topk(5)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-8)
            assert top[0][0] == tok  # greedy takes the best
    # A sampled token outside the top-K is added after it, with its own log-probability.
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=1, logprobs=1, ignore_eos=True))
    assert all(len(top) in (1, 2) for o in sampled for top in o.logprobs)
    for o in sampled:
        for tok, top in zip(o.token_ids, o.logprobs, strict=True):
            assert tok in [t for t, _ in top]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(choices=CHOICES, seed=11),
        SamplingParams(json_schema=SMALL_SCHEMA, max_new_tokens=40, seed=12),
        SamplingParams(regex=REGEX, max_new_tokens=30, seed=13, logprobs=3),
        SamplingParams(max_new_tokens=12, seed=14, logprobs=2, ignore_eos=True),
        SamplingParams(choices=CHOICES, temperature=0),
        SamplingParams(json_schema=SMALL_SCHEMA, max_new_tokens=40, temperature=0),
    ]


def _same(a, b):
    assert (a.request_id, a.sample_index, a.text, a.token_ids, a.finish_reason) == (
        b.request_id,
        b.sample_index,
        b.text,
        b.token_ids,
        b.finish_reason,
    )
    if a.choice_logprobs is not None:
        assert b.choice_logprobs == pytest.approx(a.choice_logprobs, abs=1e-9)
    if a.logprobs is not None:
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=1e-9)


def test_constrained_rows_are_exact_under_preemption(engine, tiny_model_dir):
    prompts = _prompts(12, engine.vocab_size, seed=8)
    params = [_mixed_params()[i % 6] for i in range(12)]
    want = engine.generate(prompts, params)
    small = _engine(tiny_model_dir, num_blocks=24, max_num_seqs=12)
    got = small.generate(prompts, params)
    assert small.stats.preemptions > 0
    for a, b in zip(want, got, strict=True):
        _same(a, b)


def _run(engine, prompts, params, stop_after: int | None = None):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"row-{i}", p, sp)
    outs = {}
    steps = 0
    while engine.has_unfinished() and (stop_after is None or steps < stop_after):
        for o in engine.step():
            outs[o.request_id, o.sample_index] = o
        steps += 1
    return outs


def test_constrained_rows_are_exact_after_resume(engine):
    """Interrupt after a few steps, keep only the snapshot (the engine forgets every request), resume it."""
    prompts = _prompts(8, engine.vocab_size, seed=9)
    params = [
        *_mixed_params(),
        SamplingParams(choices=CHOICES, seed=21, n=2),
        SamplingParams(max_new_tokens=5, seed=22, n=3),
    ]
    want = _run(engine, prompts, params)
    for stop_after in (2, 6):
        outs = _run(engine, prompts, params, stop_after=stop_after)
        states = engine.snapshot()
        assert states  # something was in flight
        for i in range(len(prompts)):
            engine.abort(f"row-{i}")
        assert not engine.has_unfinished() and not engine.scheduler.waiting and not engine.scheduler.running
        for st in states:
            engine.add_request(
                st.request_id, st.prompt_ids, st.params, st.output_ids, sample_index=st.sample_index
            )
        while engine.has_unfinished():
            for o in engine.step():
                assert (o.request_id, o.sample_index) not in outs
                outs[o.request_id, o.sample_index] = o
        assert sorted(outs) == sorted(want)
        for k, o in want.items():
            _same(o, outs[k])


def test_n_samples_share_the_prompts_kv(tiny_model_dir):
    engine = _engine(tiny_model_dir, block_size=16)
    prompt = _prompts(1, engine.vocab_size, seed=10)[0] * 5
    prompt = (prompt * 10)[:33]  # two full blocks and one token
    outs = engine.generate([prompt], SamplingParams(max_new_tokens=6, seed=3, n=4, ignore_eos=True))
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # each sample has its own sampler key
    # The prompt was computed once; each other sample only recomputes the token after the shared blocks.
    assert engine.stats.computed_prompt_tokens == 33 + 3 * 1
    assert engine.stats.cached_prompt_tokens == 3 * 32
    # The samples are those of a run without sharing.
    alone = _engine(tiny_model_dir, block_size=16, enable_prefix_caching=False)
    for o, a in zip(
        outs,
        alone.generate([prompt], SamplingParams(max_new_tokens=6, seed=3, n=4, ignore_eos=True)),
        strict=True,
    ):
        assert o.token_ids == a.token_ids
    assert alone.stats.computed_prompt_tokens == 4 * 33


def test_sampling_params_carry_the_new_fields():
    p = SamplingParams(choices=["a", "b"], logprobs=2, n=3, seed=1)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    s = SamplingParams(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    assert list(json.loads(s.json_schema)["properties"]) == ["b", "a"]  # key order drives output order
    assert SamplingParams.from_dict(s.to_dict()) == s
    assert "choices" not in SamplingParams().to_dict()  # old fingerprints stay as they were
    for bad, field in [
        ({"choices": "a,b"}, "choices"),
        ({"choices": []}, "choices"),
        ({"choices": ["a", "a"]}, "choices"),
        ({"json_schema": "{nope"}, "json_schema"),
        ({"json_schema": "[1]"}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"regex": "a", "choices": ["a"]}, "exclude"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 0}, "n must"),
    ]:
        with pytest.raises(ConfigError, match=field):
            SamplingParams(**bad)


def test_a_finished_answer_is_checked_against_the_users_own_schema_or_regex():
    """The grammar checks tokens; the text is their decoding, and llguidance's checks are not all the
    schema's: a text its schema or regex does not allow is an error naming why, never a finished answer."""
    from batchjob.engine.grammar import answer_error

    no_backslash = json.dumps({"type": "string", "pattern": "^[^\\\\]+$"})
    assert answer_error(no_backslash, None, '"xy"') is None
    assert "does not satisfy the JSON schema" in answer_error(no_backslash, None, '"x\\\\"')
    date = json.dumps({"type": "string", "format": "date"})
    assert answer_error(date, None, '"2024-02-29"') is None
    assert "does not satisfy the JSON schema" in answer_error(date, None, '"2023-02-29"')
    assert "is not JSON" in answer_error(date, None, '"2023-')
    assert answer_error(None, r"\s[a-z]+", " yes") is None
    assert "does not match the regex" in answer_error(None, r"\s[a-z]+", "yes")  # a first space dropped
    assert answer_error(None, r"\p{L}+", "é1") is None  # a regex Python's re cannot read is left unchecked


def test_a_regex_llguidance_and_pythons_re_read_differently_is_refused():
    """'[[:alpha:]]{3}' is three letters to llguidance and, to Python's re, a set of '[:alph' then a ']':
    every answer failed the check, each row an error blaming the tokenizer. Refused before any work."""
    for pattern, what in [
        ("[[:alpha:]]{3}", "the POSIX class [:alpha:] at position 1"),
        ("[^[:digit:]]+", "the POSIX class [:digit:] at position 2"),
        ("[a[bc]]", "a nested set at position 2"),
        ("[a-z&&[^aeiou]]", "the set operation '&&' at position 4"),
        (r"[\d--5]", "the set operation '--' at position 3"),
    ]:
        with pytest.raises(ConfigError, match="reads differently in llguidance") as e:
            SamplingParams(regex=pattern)
        assert what in str(e.value) and repr(pattern) in str(e.value)
    for fine in [r"\[[a-z]\]", "[]a]", r"[\[]", "[a|b]", "[^]x]+", "a[b]c[d]", REGEX]:
        SamplingParams(regex=fine)
    # a schema's patterns are checked by Python's re too (jsonschema): every row was an error after the run
    word = {"type": "string", "pattern": "^[[:alpha:]]{3}$"}
    for schema, where in [
        ({"type": "object", "properties": {"w": word}}, "json_schema.properties.w.pattern"),
        ({"type": "object", "patternProperties": {"^[a&&b]": {}}}, "json_schema.patternProperties key"),
        ({"type": "array", "items": [word]}, "json_schema.items[0].pattern"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(f"{where} ") + ".* reads differently in llguidance"):
            SamplingParams(json_schema=json.dumps(schema))
    SamplingParams(json_schema=json.dumps({"enum": ["[[:alpha:]]"]}))  # a value, not a pattern


def test_a_verbose_regex_s_comments_are_no_dialect_gap_and_its_whitespace_is_read_as_both_read_it():
    """'(?x) [a-z]+ # a word [[ here' was refused for the '[[' in its comment, which neither reads. Measured
    with llguidance 1.9 in verbose mode: a line break or a tab is the character itself (so '(?x)a # c\\nb'
    answers 'a', its comment running past the line break, where Python reads 'ab'), and a space or '#' in a
    set is ignored or a comment ('(?x)[a b]c' never answers ' c'): those are refused before any work."""
    for fine in [
        "(?x) [a-z]+  # a word [[ here",
        r"(?x) \d+ \# \ [a-z]  # an escaped '#' and space: [[:alpha:]]",
        "(?x) [a-z]+ \x0b [0-9]  # the whitespace both ignore",
        "(?x)(a) # [[",
        "(?x)[a\tb]c  # a tab in a set: the character in both",
        "(?x:a b)[ ]c  # the group's flag ends with it: a space in a set outside",
    ]:
        SamplingParams(regex=fine)
    SamplingParams(json_schema=json.dumps({"type": "string", "pattern": "(?x) ^[a-z]+$  # [[ a word"}))
    for pattern, what in [
        ("(?x) [[:alpha:]]+  # letters", "the POSIX class [:alpha:] at position 6"),
        (r"(?x) \#[a[b]]", "a nested set at position 9"),
        ("(?x)a(?-x: # [[)", "a nested set at position 14"),
        ("(?x) [#a]", "the '#' in a set at position 6 in verbose mode"),
        (
            "(?x) [a b]",
            "the ' ' in a set at position 7 in verbose mode (llguidance: ignored; Python: the character",
        ),
        (
            "(?x) a  # one\n b  # two",
            "the '\\n' at position 13 in verbose mode (llguidance: the character itself",
        ),
        ("(?x) a\tb", "the '\\t' at position 6"),
        ("(?x) a\u00a0b", "the '\\xa0' at position 6 in verbose mode (llguidance: ignored"),
    ]:
        with pytest.raises(ConfigError, match="reads differently in llguidance") as e:
            SamplingParams(regex=pattern)
        assert what in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=re.escape("json_schema.pattern ")):
        SamplingParams(json_schema=json.dumps({"type": "string", "pattern": "(?x) [a-z]  # a\n [[:alpha:]]"}))


def test_a_class_escape_llguidance_reads_otherwise_is_refused():
    """Measured over the BMP (llguidance 1.9, Python 3.11): a regex's \\w takes 1,410 combining marks more in
    llguidance ('कि' for \\w+: every such answer failed Python's check after the work) and 300 characters
    fewer (²); a schema pattern's \\D and \\W are wider in llguidance than in Python ('٣', 'é' written,
    then failed), its \\d and \\w ASCII, as JSON Schema reads them (taken). Refused before any work; \\d of a regex and \\s agree (but for U+001C-U+001F, which only Python's \\s
    takes), and the classes spelled out read the same in both."""
    for pattern, what in [
        (r"\w+", r"the class \w at position 0 (\w takes combining marks and not ² or ½ in llguidance"),
        (r"[a-z]+\W", r"the class \W at position 6"),
        (r"[\w.]+@x", r"the class \w at position 1"),
    ]:
        with pytest.raises(ConfigError, match="reads differently in llguidance") as e:
            SamplingParams(regex=pattern)
        assert what in str(e.value) and "spell it out: [" in str(e.value), str(e.value)
    for fine in [r"\d+", r"\s*(yes|no)\S", r"\\w", r"[A-Za-z0-9_À-ÿ]+"]:
        SamplingParams(regex=fine)
    for pattern, what in [
        (
            "^\\D+$",
            "the class \\D at position 1 (\\D takes all but [0-9] in llguidance, all but Unicode's digits in "
            "Python's re); spell it out: [^0-9], adding the digits (٠-٩) you mean",
        ),
        ("^\\W+$", "the class \\W at position 1 (\\W takes all but [A-Za-z0-9_] in llguidance"),
        ("^[\\D]$", "spell it out: [^0-9]"),
    ]:
        with pytest.raises(ConfigError, match=re.escape("json_schema.pattern ")) as e:
            SamplingParams(json_schema=json.dumps({"type": "string", "pattern": pattern}))
        assert what in str(e.value), str(e.value)
    # a schema's \\d and \\w: ASCII to llguidance, as JSON Schema reads them, within Python's: every
    # answer written passes the check (a date's pattern was refused)
    for fine in ["^\\s+$", "^[0-9٠-٩]+$", "^\\d{4}-\\d{2}-\\d{2}$", "^\\w+$"]:
        SamplingParams(json_schema=json.dumps({"type": "string", "pattern": fine}))


REQUIRED_UNLISTED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
ALL_OF = {
    "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
    ]
}


def test_objects_are_closed_to_keys_the_schema_does_not_name_without_losing_its_answers():
    """Closing objects (additionalProperties: false) refused valid schemas as unsatisfiable: 'required
    property 'b' is unsatisfiable' for a key required and not listed, and for two allOf branches each
    naming its own key. The required key is listed (any value); an allOf's branches stay open; under 'not'
    closing would let answers through, so it is left as written; a property named like a keyword is one; a
    schema closing still leaves without an answer compiles as written."""
    from batchjob.engine.grammar import _no_extra_keys

    for schema in (REQUIRED_UNLISTED, ALL_OF):
        SamplingParams(json_schema=schema)  # compiles
    # one closing still leaves no answer to (a key beyond 'a'): compiled as written
    more = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2}
    SamplingParams(json_schema=more)
    assert _no_extra_keys(REQUIRED_UNLISTED) == REQUIRED_UNLISTED | {
        "properties": {"a": {"type": "integer"}, "b": {}},
        "additionalProperties": False,
    }
    assert _no_extra_keys(ALL_OF) == ALL_OF
    negated = {"type": "object", "not": {"properties": {"a": {"type": "string"}}, "required": ["a"]}}
    assert _no_extra_keys(negated) == negated
    named = {"type": "object", "properties": {"not": {"type": "object", "properties": {"x": {}}}}}
    assert _no_extra_keys(named)["properties"]["not"]["additionalProperties"] is False


def test_answers_to_schemas_closing_would_refuse_are_valid_and_hold_only_the_named_keys(engine32):
    prompts = _prompts(6, engine32.vocab_size, seed=13)
    for schema in (REQUIRED_UNLISTED, ALL_OF):
        params = SamplingParams(json_schema=schema, max_new_tokens=40, temperature=1.0, seed=2)
        for o in engine32.generate(prompts, params):
            assert o.error is None, o.error
            answer = json.loads(o.text)
            jsonschema.validate(answer, schema)
            assert set(answer) == {"a", "b"}, o.text


@pytest.mark.engine
def test_an_answer_the_grammar_let_through_and_the_schema_does_not_is_an_error(tmp_path):
    """llguidance 1.9 lets an escaped backslash through a pattern's negated class (``[^\\\\]``): sampled
    answers of a model that likes backslashes are each valid under the schema, or an error naming it."""
    from tests.tiny_models import make_scripted_model, make_tokenizer

    tok = make_tokenizer(tmp_path)
    first = tok("Q", add_special_tokens=False).input_ids[0]
    make_scripted_model(tmp_path, tok, [first, *tok('"x\\\\"', add_special_tokens=False).input_ids])
    engine = Engine.from_pretrained(str(tmp_path), dtype="float32", device="cpu")
    schema = {"type": "string", "pattern": "^[^\\\\]+$"}
    params = [
        SamplingParams(max_new_tokens=64, temperature=1.0, seed=s, json_schema=schema) for s in range(20)
    ]
    for out in engine.generate([[first]] * 20, params):
        valid = out.error is None and jsonschema.Draft202012Validator(schema).is_valid(json.loads(out.text))
        assert valid or "does not satisfy the JSON schema" in (out.error or ""), (out.text, out.error)


@pytest.mark.engine
def test_a_longer_choice_than_another_can_be_the_answer(tmp_path):
    """'yes' ends where 'yes!' goes on: its probability held the longer one's, so greedy never answered 'yes!'
    (-0.29 against -0.43 for a model that says 'yes!' then stops: HF gives 'yes' + EOS -8.4)."""
    from tests.tiny_models import make_scripted_model, make_tokenizer

    tok = make_tokenizer(tmp_path)
    first = tok("Q", add_special_tokens=False).input_ids[0]
    make_scripted_model(tmp_path, tok, [first, *tok("yes!", add_special_tokens=False).input_ids])
    engine = Engine.from_pretrained(str(tmp_path), dtype="float64", device="cpu")
    out = engine.generate([[first]], SamplingParams(choices=["yes", "yes!"], temperature=0))[0]
    assert out.text == "yes!" and out.choice_logprobs["yes!"] > out.choice_logprobs["yes"]
    assert sum(math.exp(v) for v in out.choice_logprobs.values()) <= 1 + 1e-12  # no mass counted twice


def test_an_answer_the_engine_closed_near_its_token_limit_says_length(engine32):
    """Near max_new_tokens a JSON answer is steered to close, the engine picking among the tokens the grammar
    allows: such an answer is the engine's doing, and finishes 'length' (a resumed row says the same);
    with room, the same rows are the model's own and finish 'stop'."""
    schema = {"enum": ["alpha", "beta", "gamma"]}
    prompts = _prompts(8, engine32.vocab_size, seed=12)
    short = [SamplingParams(json_schema=schema, max_new_tokens=10, temperature=0)] * len(prompts)
    roomy = [SamplingParams(json_schema=schema, max_new_tokens=64, temperature=0)] * len(prompts)
    want = _run(engine32, prompts, short)
    assert {o.finish_reason for o in want.values()} == {"length"}
    assert {o.finish_reason for o in _run(engine32, prompts, roomy).values()} == {"stop"}
    _run(engine32, prompts, short, stop_after=2)
    states = engine32.snapshot()
    for i in range(len(prompts)):
        engine32.abort(f"row-{i}")
    for st in states:
        engine32.add_request(st.request_id, st.prompt_ids, st.params, st.output_ids)
    resumed = _run(engine32, [], [])
    assert resumed and len(states) == len(resumed)
    assert {k: o.finish_reason for k, o in resumed.items()} == {k: want[k].finish_reason for k in resumed}
