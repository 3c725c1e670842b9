"""The Python API where a caller's ids, prompts and parameters meet the engine's own: ids the engine gives its
helper requests, a request's samples, a refused batch, a prompt list given as one text, parameters changed
after a request was added."""

from __future__ import annotations

import pytest

from batchjob.engine import Engine
from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), dtype="float64", num_speculative_tokens=0)


def _drain(engine):
    outs = {}
    while engine.has_unfinished():
        outs |= {(o.request_id, o.sample_index): o for o in engine.step()}
    return outs


def test_a_choices_requests_helpers_never_take_a_callers_id(engine):
    """Choices score the labels decoding did not reach with helper requests; they were named 'c@<node>', so a
    caller's request 'c@1' was overwritten (a KeyError, and a job with such ids never finished)."""
    engine.add_request(
        "c", [5, 6, 7], SamplingParams(choices=["alpha beta gamma", "alpha", "zeta"], temperature=0)
    )
    for i in range(1, 8):
        engine.add_request(f"c@{i}", [5, 6, i + 7], GREEDY)
    outs = _drain(engine)
    assert sorted(outs) == sorted([("c", 0)] + [(f"c@{i}", 0) for i in range(1, 8)])
    assert all(o.error is None for o in outs.values())
    with pytest.raises(ConfigError, match="NUL character"):
        engine.add_request("c\x00choice1", [5, 6], GREEDY)


def test_a_request_id_in_use_is_refused_before_any_sample_is_added(engine):
    engine.add_request("a", [5, 6, 7], GREEDY)
    with pytest.raises(ConfigError, match="request id 'a' is already in the engine"):
        engine.add_request("a", [9, 9, 9], GREEDY.replace(n=2, temperature=1.0))  # (two results under one id)
    engine.add_request("x#1", [5, 6], GREEDY)
    with pytest.raises(ConfigError, match="request id 'x#1' is already in the engine"):
        engine.add_request("x", [7, 8], GREEDY.replace(n=2, temperature=1.0))
    assert sorted(_drain(engine)) == [("a", 0), ("x#1", 0)]  # no x#0 left behind


def test_a_refused_batch_leaves_the_engine_idle_and_one_text_is_one_prompt(engine):
    with pytest.raises(ConfigError, match="unknown LoRA adapter 'nope'"):
        engine.generate(["a b", "c d", "e f"], GREEDY, adapters=[None, None, "nope"])
    assert not engine.has_unfinished()
    [one] = engine.generate("hello there", GREEDY)  # one text: one prompt (it was one a character)
    assert one.token_ids == engine.generate(["hello there"], GREEDY)[0].token_ids
    with pytest.raises(ConfigError, match="got the integer 5 as a prompt"):
        engine.generate([5, 6, 7], GREEDY)


def test_parameters_changed_after_add_request_do_not_reach_the_request(engine):
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    params.max_new_tokens = 2
    assert len(_drain(engine)["a", 0].token_ids) == 6
