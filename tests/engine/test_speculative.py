"""Speculative decoding by prompt lookup: same tokens as one-at-a-time decoding, in fewer steps."""

from __future__ import annotations

import random
import re

import pytest

from batchjob import Engine, SamplingParams
from batchjob.engine.block_manager import BlockManager
from batchjob.engine.ngram import KeptRate, NgramIndex, SpecState
from batchjob.engine.request import Request
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.speculative import (
    PROBE_STEPS,
    Drafter,
    StepCost,
    draft,
    record,
    trim,
    window,
)
from tests.engine.test_engine import _hf
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


def test_a_draft_pays_while_its_chance_of_being_kept_beats_what_its_row_costs():
    assert window(0.9, 0.5, 4) == 4  # 0.9, 0.81, 0.73, 0.66: all above half a step
    assert window(0.9, 0.75, 4) == 2  # 0.73 is not
    assert window(0.4, 0.5, 4) == 0
    assert window(0.4, 0.0, 4) == 4  # rows that cost nothing: every draft pays
    rate = KeptRate(decay=1.0)
    assert rate.rate(prior=0.7) == 0.7  # no evidence: the prior
    rate.add(4, 4)  # all kept
    rate.add(3, 1)  # one kept, then a rejection
    assert rate.rate(prior=0.5, weight=2) == (5 + 1) / (5 + 1 + 2)


def test_step_cost_fit_tells_a_steps_fixed_cost_prompt_tokens_and_sampled_rows_apart():
    cost = StepCost(prior_step_rows=12.0)
    assert cost.coefficients() == (12.0, 0.5, 1.0)  # no steps yet: the prior
    for prompt, sampled in ((0, 1), (448, 64), (0, 8), (300, 40), (500, 12), (0, 3), (0, 64), (128, 64)):
        cost.observe(prompt, sampled, 0.050 + 0.001 * prompt + 0.002 * sampled)  # 50 ms, 1 ms, 2 ms
    alpha, beta_prompt, beta_row = cost.coefficients()
    assert abs(alpha - 25.0) < 1e-6 and abs(beta_prompt - 0.5) < 1e-9 and beta_row == 1.0
    assert abs(cost.threshold(75, 0, 75) - 0.75) < 1e-6  # 75 outputs of a 100-row step
    assert abs(cost.threshold(25, 400, 25) - 0.1) < 1e-6  # prompt rows in the step: its tokens cost more
    decode_only = StepCost(prior_step_rows=12.0)
    for sampled in (1, 64, 8, 40, 3, 64):  # no prompt rows: the fixed cost and the row's, from decodes
        decode_only.observe(0, sampled, 0.050 + 0.002 * sampled)
    assert abs(decode_only.coefficients()[0] - 25.0) < 1e-6
    alike = StepCost(prior_step_rows=12.0)
    for _ in range(6):  # every step the same: nothing to tell apart
        alike.observe(0, 64, 0.2)
    assert alike.coefficients() == (12.0, 0.5, 1.0)


def _decoding(rid: str, bm: BlockManager) -> Request:
    """A request that repeats itself (the lookup always has a match), decoding."""
    r = Request(rid, [1, 2, 3, 4] * 4, 16, SamplingParams(max_new_tokens=50), 0.0)
    assert bm.allocate(r, 16)
    r.num_computed_tokens = 15
    return r


def _drafts(drafter: Drafter, running: list[Request], bm: BlockManager, waiting=()) -> list[int]:
    drafted = drafter.draft(running, list(waiting), bm, 1000)
    counts = [r.num_draft_tokens for r in running]
    for r in drafted:  # undo, as a step that verified nothing would
        del r.token_ids[-r.num_draft_tokens :]
        r.num_draft_tokens = 0
    return counts


def test_drafter_drafts_where_it_pays_and_probes_where_it_does_not():
    bm = BlockManager(200, 16)
    running = [_decoding(f"r{i}", bm) for i in range(64)]
    drafter = Drafter(4, "cpu", 512, 64)
    for rows in (8, 64, 30, 64, 2, 64):  # 50 ms a step + 4 ms a row: a step is worth 12.5 rows
        drafter.observe(0, rows, 0.050 + 0.004 * rows)
    queued = [Request("q", [5, 6, 7], 3, SamplingParams(max_new_tokens=50), 0.0)]  # waits for a seat
    # 64 rows: a draft must be kept 84% of the time to pay; a new request's prior is 50%
    assert _drafts(drafter, running, bm, queued) == [0] * 64
    # nobody waits: the run ends with its longest requests, and for them a kept draft saves a whole step
    # (1.3% of 76.5 rows' worth: the prior pays for the full window); a request with less than half the
    # longest one's tokens left does not end the run: the throughput bar
    running[1].params = SamplingParams(max_new_tokens=20)
    assert _drafts(drafter, running, bm)[:3] == [4, 0, 4]
    running[1].params = running[0].params
    for r in running[:2]:  # two requests whose drafts have all been kept (95% with the prior): they draft,
        for _ in range(10):  # as long as 0.95 ** j beats 84%: 3 drafts
            record(r, 4, 4)
    assert _drafts(drafter, running, bm, queued)[:3] == [3, 3, 0]
    # two requests: with others waiting a draft pays when kept 14% of the time (the prior's 50% pays for
    # two); with none (the run's tail) 7% (three)
    few = [_decoding(f"t{i}", bm) for i in range(2)]
    assert _drafts(drafter, few, bm, queued) == [2, 2]
    assert _drafts(drafter, few, bm) == [3, 3]
    # a request that can't pay drafts one token every PROBE_STEPS steps, to see whether its text loops
    for r in running[2:]:
        r.spec.idle = 0
    counts = [_drafts(drafter, running, bm, queued)[2] for _ in range(PROBE_STEPS)]
    assert counts == [0] * (PROBE_STEPS - 1) + [1]
    for _ in range(20):  # the job's drafts are kept (its text loops): a new request starts from that
        drafter.record(running[0], 4, 4)
    assert _drafts(drafter, [_decoding("new", bm)], bm) == [4]


def test_drafter_leaves_a_full_token_budget_to_prompts():
    bm = BlockManager(400, 16)
    running = [_decoding(f"r{i}", bm) for i in range(4)]
    for r in running:
        r.spec = SpecState()
        for _ in range(10):
            r.spec.kept.add(4, 4)
    drafter = Drafter(4, "cpu", 512, 64)
    assert _drafts(drafter, running, bm) == [4] * 4
    waiting = [
        Request(f"w{i}", list(range(5, 205)), 200, SamplingParams(max_new_tokens=5), 0.0) for i in range(3)
    ]
    assert _drafts(drafter, running, bm, waiting) == [0] * 4  # 4 + 600 prompt tokens: over the budget
    # 404 rows: drafts pay (4 outputs in a step of 416 rows' worth) and fit, 16 of room for 108
    assert _drafts(drafter, running, bm, waiting[:2]) == [4] * 4
    drafter.budget = 410
    assert _drafts(drafter, running, bm, waiting[:2]) == [4, 2, 0, 0]  # room for 6


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


@pytest.mark.parametrize(("num_blocks", "drafts"), [(4 + 2, 0), (4 + 3, 3)])
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
    assert len(drafted) == (drafts > 0)


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


def test_greedy_with_drafts_equals_hf_generate(tiny_model_dir, decode_path, drafts_pay):
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
def test_drafts_change_no_token(decisive_model_dir, params, drafts_pay):
    # The sharpened head: sampled at temperature 0.3, its text repeats enough for drafts to be proposed and
    # taken (the ordinary model's near-uniform picks rarely repeat an n-gram).
    want, _ = _run(decisive_model_dir, 0, params)
    got, engine = _run(decisive_model_dir, 6, params)
    assert got == want
    if params.max_new_tokens > 3:
        assert engine.stats.draft_tokens > 0


def test_drafts_under_preemption_and_a_small_budget(tiny_model_dir, drafts_pay):
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    want, _ = _run(tiny_model_dir, 0, params)
    got, engine = _run(tiny_model_dir, 4, params, block_size=4, num_blocks=24, max_num_batched_tokens=6)
    assert got == want
    assert engine.stats.draft_tokens > 0


def test_constrained_rows_beside_drafting_rows(tiny_model_dir, drafts_pay):
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
