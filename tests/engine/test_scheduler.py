"""Scheduler and block manager in pure Python: plans are checked without running a model."""

from __future__ import annotations

import pytest

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.request import Request, RequestStatus
from batchjob.engine.scheduler import Scheduler
from batchjob.engine.tasks.policy import ChunkGrid
from batchjob.sampling import SamplingParams

pytestmark = pytest.mark.timeout(30)


def _req(rid: str, n: int, base: int | None = None) -> Request:
    """A request of ``n`` prompt tokens; distinct ids get distinct tokens unless ``base`` is shared."""
    base = sum(map(ord, rid)) * 1000 if base is None else base
    return Request(rid, list(range(base, base + n)), n, SamplingParams(max_new_tokens=8, temperature=0), 0.0)


def _run(plan, bm: BlockManager | None = None):
    """Pretend the forward ran: advance counters, append a token to requests that reached the end, and
    (given the block manager) offer their full blocks to the prefix cache, as the engine does."""
    for req, n in zip(plan.requests, plan.num_tokens, strict=True):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(1)
        if bm is not None:
            bm.register_full_blocks(req)


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = _req("a", 5)
    assert bm.allocate(r, 5) and len(r.block_ids) == 2
    assert bm.allocate(r, 8) and len(r.block_ids) == 2  # still fits
    assert not bm.allocate(r, 17)  # needs 5 blocks, only 4 exist
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 2  # a failed allocation takes nothing
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4


def test_a_growing_pool_reuses_released_blocks_before_taking_new_ones():
    """With ``grow`` (the CPU's pool, whose memory is taken as blocks are first written), the blocks handed
    out stay as few as the most ever in use at once; all of them are still free to take."""
    bm = BlockManager(num_blocks=8, block_size=4, grow=True)
    assert bm.num_free_blocks == 8 and bm.grown == 0
    a, b = _req("a", 8), _req("b", 4)
    assert bm.allocate(a, 8) and bm.allocate(b, 4) and bm.grown == 3
    bm.free(a)
    c = _req("c", 12)
    assert bm.allocate(c, 12) and sorted(c.block_ids) == [0, 1, 3] and bm.grown == 4
    assert bm.num_free_blocks == 4 and not bm.allocate(_req("d", 20), 20)  # 5 > 4: nothing taken
    assert bm.grown == 4 and bm.allocate(_req("e", 16), 16) and bm.grown == 8 and bm.num_free_blocks == 0
    assert BlockManager(num_blocks=8, block_size=4).grown == 8  # without grow: the whole pool from the start


def test_chunked_prefill_shares_the_budget_with_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=10, max_num_seqs=4)
    a, b = _req("a", 3), _req("b", 25)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["a", "b"] and plan.num_tokens == [3, 7]
    _run(plan)
    plan = sched.schedule()  # a decodes (1 token), b continues its prompt with the rest of the budget
    assert plan.num_tokens == [1, 9]
    _run(plan)
    plan = sched.schedule()
    assert plan.num_tokens == [1, 9]
    _run(plan)
    plan = sched.schedule()
    assert plan.num_tokens == [1, 1]  # b's prompt is done: both decode


def test_max_num_seqs_caps_running_and_finished_make_room():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    reqs = [_req(str(i), 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["0", "1"]
    _run(plan)
    sched.finish(reqs[0], RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["1", "2"] and plan.num_tokens == [1, 3]


def test_preempts_latest_admitted_and_admits_nothing_that_step():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=4)
    a, b, c = _req("a", 8), _req("b", 7), _req("c", 2)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()  # a: 2 blocks, b: 2 blocks, c must wait (no blocks left)
    assert [r.request_id for r in plan.requests] == ["a", "b"]
    _run(plan)
    plan = sched.schedule()  # a needs a 3rd block: b (admitted last) is preempted
    assert [r.request_id for r in plan.requests] == ["a"]
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.status == RequestStatus.WAITING
    assert list(sched.waiting)[:2] == [b, c]  # b goes back to the front, c was not admitted
    assert bm.num_free_blocks == 1


def test_prefix_cache_shares_full_blocks_and_evicts_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _req("a", 10, base=0)  # blocks: [0..3] [4..7] [8, 9]
    a.num_computed_tokens = 0
    assert bm.match_prefix(a) == 0 and bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.register_full_blocks(a)  # two full blocks become findable
    b = _req("b", 9, base=0)  # same first 8 tokens, one more
    assert bm.match_prefix(b) == 8 and b.block_ids == a.block_ids[:2]
    assert [bm.ref_counts[x] for x in b.block_ids] == [2, 2]
    c = _req(
        "c", 8, base=0
    )  # exactly two blocks: the last token must still be computed, so only one is taken
    assert bm.match_prefix(c) == 4
    d = Request("d", [9, 9, 9, 9, 9], 5, SamplingParams(), 0.0)  # different tokens: no hit
    assert bm.match_prefix(d) == 0
    for r in (a, b, c):
        bm.free(r)
    assert bm.ref_counts == [0] * 6 and bm.num_free_blocks == 6
    e = _req("e", 9, base=0)  # released blocks are still cached
    assert bm.match_prefix(e) == 8
    bm.free(e)
    # Taking every block overwrites them: the cache forgets what it held.
    f = Request("f", [7] * 24, 24, SamplingParams(), 0.0)
    assert bm.allocate(f, 24)
    bm.free(f)
    assert bm.match_prefix(_req("g", 9, base=0)) == 0


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=12, max_num_seqs=4)
    a, b, c = _req("a", 20, base=0), _req("b", 18, base=0), _req("c", 5)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()  # a takes the whole budget with the first chunk of its prompt
    assert [r.request_id for r in plan.requests] == ["a"]
    _run(plan, bm)
    plan = sched.schedule()  # b needs a block a is still computing: b waits, c goes ahead of it
    assert [r.request_id for r in plan.requests] == ["a", "c"]
    _run(plan, bm)
    plan = sched.schedule()  # now b finds 16 of its 18 tokens in the cache
    assert "b" in [r.request_id for r in plan.requests]
    assert b.num_computed_tokens == 16 and sched.num_cached_tokens == 16


def test_static_batching_admits_nothing_until_the_batch_finished():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2, static=True)
    reqs = [_req(str(i), 3) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["0", "1"]
    _run(plan)
    sched.finish(reqs[0], RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()  # a seat is free, but the batch is not done
    assert [r.request_id for r in plan.requests] == ["1"]
    _run(plan)
    sched.finish(reqs[1], RequestStatus.FINISHED_STOPPED)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["2", "3"]


def test_larger_output_budgets_are_admitted_first_and_preempted_requests_before_them():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=4, max_num_seqs=8)

    def add(rid: str, budget: int) -> Request:
        r = _req(rid, 4)
        r.params = SamplingParams(max_new_tokens=budget, temperature=0)
        sched.add(r)
        return r

    for rid, budget in {"a": 5, "b": 40, "c": 12, "d": 40, "e": 1}.items():
        add(rid, budget)
    admitted = []
    while sched.waiting:
        plan = sched.schedule()  # one 4-token prompt fills the budget: one admission per step
        admitted += [r.request_id for r in plan.requests]
        for r in plan.requests:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert admitted == ["b", "d", "c", "a", "e"]  # longest budget first, ties in arrival order

    short = add("short", 2)
    assert sched.schedule().requests == [short]
    add("long", 99)
    sched.running.remove(short)
    sched._preempt(short)
    assert sched._next_waiting() is short  # it had its turn already: back first, before a longer one


def _task_req(rid: str, tokens: list[int], compute_from: int) -> Request:
    from batchjob.engine.tasks.state import TaskState

    req = Request(rid, tokens, len(tokens), SamplingParams(max_new_tokens=1), 0.0)
    req.task = TaskState("score", compute_from=compute_from)
    return req


def test_a_chunk_grid_fixes_where_chunks_start_whatever_shares_the_step():
    """A task's rows (``chunk_grid``): the reusable part and the rest are each cut in whole grid chunks,
    a chunk that does not fit waits, and the cache gives the reusable part whole or nothing, so a row
    computes the same chunks alone, beside others, or after a restart."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=4, chunks=ChunkGrid(8))
    # a: 21 tokens, its result from position 13 on: cut 12 (3 blocks), chunks [0, 8) [8, 12) [12, 20) [20, 21)
    a, b = _task_req("a", list(range(21)), 13), _task_req("b", list(range(100, 105)), 0)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # a's first chunk (8); b whole (5) would need 13: b waits
    assert [r.request_id for r in plan.requests] == ["a"] and plan.num_tokens == [8]
    _run(plan, bm)
    plan = sched.schedule()  # up to a's cut (4), then b (5)
    assert [r.request_id for r in plan.requests] == ["a", "b"] and plan.num_tokens == [4, 5]
    _run(plan, bm)
    plan = sched.schedule()  # a chunk of 8 from the cut; b is done (a real engine finishes it)
    assert plan.num_tokens[0] == 8
    _run(plan, bm)
    plan = sched.schedule()
    assert plan.num_tokens[0] == 1
    _run(plan, bm)
    # a's three reusable blocks are cached with cut 12. A row with the same 12 first tokens and the same
    # cut takes them; one whose cut is 16 (it would compute [0, 8) [8, 16)) takes none, and neither does
    # one whose cut is 8 (two of the blocks, but a's first chunk ended at 8 and its second at 12: the
    # values of [4, 8) match, the decision is per part, whole or nothing).
    same = _task_req("same", list(range(12)) + [7, 7, 7], 13)
    assert bm.reusable(same) == 12 and bm.match_prefix(same, whole=True) == 12
    longer = _task_req("longer", list(range(16)) + [7], 16)
    assert bm.match_prefix(longer, whole=True) == 0 and longer.block_ids == []
    assert bm.match_prefix(longer) == 16  # without ``whole``: every matching block (a computed [12, 16) too)
    shorter = _task_req("shorter", list(range(10)), 9)
    assert bm.match_prefix(shorter, whole=True) == 0
    for r in (same, longer, shorter):
        bm.free(r)


def test_an_encoders_rows_run_whole_or_wait():
    """The prefill-only encoder's policy (tasks/policy.py): a row is never split; one that does not fit what
    is left of the budget waits for the next step, and the scheduler itself names no task."""
    from batchjob.engine.tasks.policy import WholeRows

    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=4, chunks=WholeRows())
    a = Request("a", list(range(6)), 6, SamplingParams(max_new_tokens=1), 0.0)
    b = Request("b", list(range(50, 57)), 7, SamplingParams(max_new_tokens=1), 0.0)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["a"] and plan.num_tokens == [6]
