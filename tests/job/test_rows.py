"""Row kinds (``batchjob/job/rows/``) on their own: what requests a row makes, what each finished request
turns into, and what a checkpoint saves of it and restores; no model, no engine."""

from __future__ import annotations

import pytest

from batchjob.engine.output import RequestOutput
from batchjob.engine.request import RequestState
from batchjob.io.readers import Row
from batchjob.job.checkpoint import InFlight
from batchjob.job.reasoning import ReasoningTags
from batchjob.job.rows.base import Ask
from batchjob.job.rows.embeddings import EmbeddingInputs
from batchjob.job.rows.generate import Samples
from batchjob.job.rows.reasoning import Reasoning, answer_request_id
from batchjob.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

ROW = Row(ordinal=7, source="in.jsonl", index=7, values={"q": "?"}, line=8)
TAGS = ReasoningTags("<think>", "</think>", (90,), (91,))


def out(tokens, text, k=0, rid="r7", reason="stop", error=None):
    return RequestOutput(rid, [1, 2], tokens, text, reason, error, 0.0, None, 1.0, sample_index=k)


def samples(n=1, **kw):
    return Samples(
        row=ROW, row_id="r7", prompt_ids=[1, 2], num_prompt_tokens=2, params=SamplingParams(n=n), **kw
    )


def test_a_generate_row_is_written_once_all_its_samples_are_done():
    row = samples(n=2)
    assert row.asks() == [Ask("r7", [1, 2], row.params, None)]  # one request: the engine samples it n times
    assert row.finished(out([5], "b", k=1), None) == [] and not row.done
    row.finished(out([4], "a", k=0, reason="error", error=None), None)
    assert row.done
    first, second = row.results()
    assert first["sample_index"] == 0 and first["error"] == "the engine could not run this request"
    assert first["generated_text"] is None
    assert second["generated_text"] == "b" and second["num_generated_tokens"] == 1


def test_a_checkpoint_record_is_restored_only_into_the_row_kind_that_saved_it():
    row = samples(n=2, every=True)
    params = row.params.to_dict()
    other = InFlight(7, "r7", [1, 2], {0: [4]}, params, True, "reasoning")
    row.restore(other)
    assert row.saved == {}  # another kind's work: the row starts afresh
    for kind in ("generate", None):  # None: a checkpoint from before records named their kind
        row.restore(InFlight(7, "r7", [1, 2], {0: [4]}, params, True, kind))
        assert row.saved == {0: [4]}
    asks = row.asks()  # resumed with several samples: each from its own tokens
    assert [(a.sample_index, a.output_ids) for a in asks] == [(0, [4]), (1, None)]
    states = [(None, RequestState("r7", [1, 2], [4, 6], row.params, 0))]
    assert row.in_flight(states) == InFlight(7, "r7", [1, 2], {0: [4, 6]}, params, True, "generate")


def test_checkpoint_records_round_trip_and_old_ones_load():
    record = InFlight(3, "a", [1], {0: [2, 3]}, None, False, "reasoning", [0])
    body = record.to_json()
    assert body == {
        "ordinal": 3,
        "id": "a",
        "prompt_ids": [1],
        "kind": "reasoning",
        "answering": [0],
        "output_ids": [2, 3],
    }
    assert InFlight.from_json(body) == record
    old = InFlight.from_json({"ordinal": 3, "id": "a", "prompt_ids": [1], "output_ids": [2]})
    assert old.kind is None and old.answering == [] and old.samples == {0: [2]}


def test_a_reasoning_sample_asks_for_its_answer_after_its_thinking():
    answer = SamplingParams(choices=["yes", "no"])
    row = Reasoning(
        row=ROW,
        row_id="r7",
        prompt_ids=[1, 2, 90],
        num_prompt_tokens=2,
        params=SamplingParams(max_new_tokens=3),
        answer_params=answer,
        tags=TAGS,
        inside=True,
    )
    (ask,) = row.finished(out([5, 6, 7], "hmm ok", reason="length"), None)  # ran long: the close tag is added
    assert ask.request_id == answer_request_id("r7", 0) and ask.part == 0
    assert ask.prompt_ids == [1, 2, 90, 5, 6, 7, 91] and ask.params == answer.replace(n=1)
    state = RequestState(ask.request_id, ask.prompt_ids, [], ask.params, 0)
    saved = row.in_flight([(0, state)])  # in its answer: saved as its finished thinking
    assert saved is not None and saved.samples == {0: [5, 6, 7]} and saved.answering == [0]
    assert saved.prompt_ids == [1, 2, 90] and saved.kind == "reasoning"
    assert row.finished(out([8], "yes", rid=ask.request_id), 0) == [] and row.done
    (result,) = row.results()
    assert result["generated_text"] == "yes" and result["reasoning"] == "hmm ok"
    assert result["num_generated_tokens"] == 4  # the thinking's tokens and the answer's


def test_an_embeddings_row_asks_a_request_per_input_and_names_the_failed_one():
    row = EmbeddingInputs(
        row=ROW, row_id="r7", prompt_ids=[1], num_prompt_tokens=3, task="embed", inputs=[[1], [2, 3]]
    )
    asks = row.asks()
    assert [a.part for a in asks] == [0, 1] and len({a.request_id for a in asks}) == 2
    row.finished(out([], "", rid=asks[1].request_id, reason="error", error="too long"), 1)
    assert not row.done and row.in_flight([]) is None  # prefill-only: nothing saved, computed again
    row.finished(out([], "", rid=asks[0].request_id, reason="error", error="x"), 0)
    assert [r["error"] for r in row.results()] == ["body.input[0]: x", "body.input[1]: too long"]


def test_a_restored_reasoning_row_saves_what_it_restored_until_it_is_re_added():
    thinking = SamplingParams(max_new_tokens=3)
    row = Reasoning(
        row=ROW,
        row_id="r7",
        prompt_ids=[1, 2, 90],
        num_prompt_tokens=2,
        params=thinking,
        answer_params=SamplingParams(choices=["yes", "no"]),
        tags=TAGS,
    )
    saved = InFlight(7, "r7", [1, 2, 90], {0: [5, 6, 91]}, None, False, "reasoning", [0])
    row.restore(saved)
    assert row.asks() == [Ask("r7", [1, 2, 90], thinking, [5, 6, 91])]  # its whole thinking, ended at once
    assert row.in_flight([]) == saved
