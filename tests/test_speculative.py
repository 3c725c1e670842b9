"""Speculative decoding by prompt lookup: same tokens as one-at-a-time decoding, in fewer steps."""

from __future__ import annotations

import random
import re

import pytest

from batchjob import Engine, SamplingParams
from batchjob.engine.block_manager import BlockManager
from batchjob.engine.ngram import NgramIndex
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.speculative import BACKOFF_STEPS, draft, propose, record, trim
from tests.test_engine import _hf
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.timeout(300)


def test_ngram_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex()
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert idx.propose(toks, 2) == [7, 5]  # the latest earlier "1 2 3" was followed by 7 5
    toks += [7]
    assert idx.propose(toks, 4) == [5, 1, 2, 3]  # "2 3 7" -> 5 1 2 3
    assert NgramIndex().propose([8, 8], 3) == []  # too short for a 2-gram seen before
    assert NgramIndex().propose([8, 8, 8], 3) == [8]  # "8 8" seen, followed by one 8


def test_slow_start_grows_on_kept_drafts_and_rests_after_a_miss():
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], 3, SamplingParams(max_new_tokens=50), 0.0)
    assert propose(req, 4) == [3]  # one draft at first
    record(req, 1, 1)
    assert propose(req, 4) == [3, 1]  # all kept: the window doubles
    record(req, 2, 2)
    assert propose(req, 4) == [3, 1, 2]  # window 4: all that followed the latest "3 1 2"
    record(req, 4, 1)  # one kept, then a miss: back to one draft
    assert req.spec.window == 1 and req.spec.backoff == 0
    record(req, 1, 0)  # nothing kept: rest
    assert [propose(req, 4) for _ in range(BACKOFF_STEPS)] == [[]] * BACKOFF_STEPS
    assert propose(req, 4) == [3]


def test_trim_keeps_only_the_drafts_the_plan_computes():
    def drafted(rid: str) -> Request:
        r = Request(rid, [5, 6, 7, 8, 90, 91, 92], 4, SamplingParams(max_new_tokens=50), 0.0)
        r.num_computed_tokens, r.num_draft_tokens = 3, 3  # real tokens 5..8, drafts 90..92
        return r

    whole, cut, left_out = drafted("whole"), drafted("cut"), drafted("left-out")
    trim([whole, cut, left_out], SchedulerOutput([whole, cut], [4, 2]))
    assert whole.token_ids[4:] == [90, 91, 92] and whole.num_draft_tokens == 3
    assert cut.token_ids[4:] == [90] and cut.num_draft_tokens == 1  # 2 tokens: the last real one and a draft
    assert left_out.token_ids == [5, 6, 7, 8] and left_out.num_draft_tokens == 0


@pytest.mark.parametrize(("num_blocks", "drafts"), [(4 + 2, 0), (4 + 3, 1)])
def test_drafting_leaves_a_block_per_running_request(num_blocks, drafts):
    """Two running requests, each at the end of a full block: a draft needs a new block, and it only
    gets one when a block per running request stays free afterwards (drafts never cause preemption)."""
    bm = BlockManager(num_blocks, 4)
    running = []
    for rid in ("a", "b"):
        r = Request(rid, [1, 2, 3, 1, 2, 3, 1, 2], 4, SamplingParams(max_new_tokens=50), 0.0)
        assert bm.allocate(r, 8)  # 2 blocks each: 4 taken
        r.num_computed_tokens = 7
        running.append(r)
    drafted = draft(running, bm, 4, 1000)
    assert [r.num_draft_tokens for r in running] == [drafts, 0]
    assert len(drafted) == drafts


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    loop = [rng.randrange(3, vocab) for _ in range(5)]
    return [
        loop * 6,  # a prompt that repeats itself: the lookup has something to copy
        [rng.randrange(3, vocab) for _ in range(40)],
        (loop[:3] + [7]) * 4 + [rng.randrange(3, vocab) for _ in range(9)],
        [rng.randrange(3, vocab) for _ in range(3)],
    ]


def _run(folder, k: int, params, **kw) -> tuple[list[list[int]], Engine]:
    engine = Engine.from_pretrained(
        str(folder), dtype="float64", device="cpu", num_speculative_tokens=k, **kw
    )
    outs = engine.generate(_prompts(engine.vocab_size), params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [o.token_ids for o in outs], engine


def test_greedy_with_drafts_equals_hf_generate(tiny_model_dir, decode_path):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    got, engine = _run(tiny_model_dir, 4, params, block_size=4)
    assert engine.stats.draft_tokens > 0 and engine.stats.accepted_draft_tokens > 0
    assert engine.stats.steps < 40  # fewer forwards than tokens of the longest answer
    hf = _hf(tiny_model_dir)
    for p, toks in zip(_prompts(engine.vocab_size), got, strict=True):
        assert toks == hf_greedy(hf, p, 40)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30, temperature=0.3, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0),  # stops at EOS where the model says it
        SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),  # budget shorter than a draft
    ],
    ids=["seeded", "eos", "short"],
)
def test_drafts_change_no_token(decisive_model_dir, params):
    # The sharpened head: sampled at temperature 0.3, its text repeats enough for drafts to be proposed and
    # taken (the ordinary model's near-uniform picks rarely repeat an n-gram).
    want, _ = _run(decisive_model_dir, 0, params)
    got, engine = _run(decisive_model_dir, 6, params)
    assert got == want
    if params.max_new_tokens > 3:
        assert engine.stats.draft_tokens > 0


def test_drafts_under_preemption_and_a_small_budget(tiny_model_dir):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    want, _ = _run(tiny_model_dir, 0, params)
    got, engine = _run(tiny_model_dir, 4, params, block_size=4, num_blocks=24, max_num_batched_tokens=6)
    assert got == want
    assert engine.stats.draft_tokens > 0


def test_constrained_rows_beside_drafting_rows(tiny_model_dir):
    """Grammar masks belong to their own rows when other rows of the batch verify drafts (answers long
    enough that the constrained rows are still running when the free ones start drafting)."""
    regex = r"[a-z]{20,25}"
    free = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    constrained = SamplingParams(regex=regex, max_new_tokens=30, seed=2)
    results = {}
    for k in (0, 4):
        engine = Engine.from_pretrained(
            str(tiny_model_dir), dtype="float64", device="cpu", num_speculative_tokens=k
        )
        prompts = _prompts(engine.vocab_size)
        params = [free, constrained, free, constrained]
        outs = engine.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        for o, p in zip(outs, params, strict=True):
            if p is constrained:
                assert re.fullmatch(regex, o.text), o.text
        results[k] = [o.token_ids for o in outs]
        if k:
            assert engine.stats.draft_tokens > 0
    assert results[4] == results[0]
