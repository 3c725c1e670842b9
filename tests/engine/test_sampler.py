"""The batched sampler: filters behave, noise is a pure function of (seed, key, position)."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.sampler import argmax_rows, sample, uniform_noise
from batchjob.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)


def test_noise_is_a_function_of_seed_key_position():
    s, k, p = torch.tensor([1, 1, 2]), torch.tensor([5, 5, 5]), torch.tensor([0, 0, 0])
    u = uniform_noise(s, k, p, 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.03
    alone = uniform_noise(torch.tensor([2]), torch.tensor([5]), torch.tensor([0]), 1000)
    assert torch.equal(alone[0], u[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_argmax_rows_is_argmax_on_ties_nans_and_infinities(dtype):
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows, vocab = 1 + trial % 17, int(torch.randint(1, 160_000, (), generator=gen))
        x = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype)  # ties everywhere
        if trial % 3 == 0:
            x[0, torch.randint(0, vocab, (3,), generator=gen)] = float("nan")
        if trial % 4 == 0:
            x[-1] = float("-inf")
        if trial % 5 == 0:
            x[-1, torch.randint(0, vocab, (2,), generator=gen)] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (trial, rows, vocab)


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=2),
        SamplingParams(temperature=1.0, min_p=1.0, seed=3),
    ]
    assert sample(logits, params, [0, 1, 2, 3], [0, 0, 0, 0]) == best


def test_top_k_and_top_p_keep_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k, seen_p = set(), set()
    for pos in range(200):
        seen_k |= set(sample(logits, [SamplingParams(top_k=2, seed=9)], [1], [pos]))
        seen_p |= set(sample(logits, [SamplingParams(top_p=0.7, seed=9)], [1], [pos]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.7; token 2 starts above it


def test_top_k_keeps_ties_and_top_p_keeps_the_fewest_tokens_reaching_it_as_hf_does():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    cases = [
        (torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]]), dict(top_k=2), TopKLogitsWarper(2)),  # three tied second
        (torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])), dict(top_p=0.75), TopPLogitsWarper(0.75)),
        (torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])), dict(top_p=0.5), TopPLogitsWarper(0.5)),
    ]
    for logits, ours, warper in cases:
        kept = set((warper(None, logits.clone()) > float("-inf")).nonzero()[:, 1].tolist())
        seen = set()
        for pos in range(300):
            seen |= set(sample(logits, [SamplingParams(seed=4, **ours)], [1], [pos]))
        assert seen == kept, (ours, seen, kept)


def test_the_noise_never_reaches_one_so_a_filtered_token_never_wins():
    """At (seed 1234, key 46317, position 0) the noise's top code falls on column 276: it rounded to 1.0 in
    float32 before, a Gumbel draw of +inf that won over top_k=1 (and over a mask's -inf: NaN, read as the
    largest). ~V / 2**24 of all sampled tokens, 0.9% at a 151,936-token vocabulary."""
    u = uniform_noise(torch.tensor([1234]), torch.tensor([46317]), torch.tensor([0]), 300)
    assert u.max().item() == 1.0 - 2.0**-24 and u[0].argmax().item() == 276
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1))
    logits[0, 276] = logits.min() - 1
    best = logits.argmax(-1).item()
    for params in (SamplingParams(top_k=1, seed=1234), SamplingParams(min_p=1.0, seed=1234)):
        assert sample(logits, [params], [46317], [0]) == [best]
    masked = logits.clone()
    masked[0, 276] = float("-inf")
    assert sample(masked, [SamplingParams(seed=1234)], [46317], [0]) != [276]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].repeat(64, 1)
    counts = torch.zeros(3)
    params = [SamplingParams(seed=11)] * 64
    for step in range(50):
        toks = sample(logits, params, list(range(64)), [step] * 64)
        counts += torch.bincount(torch.tensor(toks), minlength=3)
    freq = counts / counts.sum()
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_apply_bitmask_masks_exactly_the_disallowed_tokens():
    from batchjob.engine.constraints import allocate_bitmask, set_allowed
    from batchjob.engine.sampler import apply_bitmask

    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    allowed = {0: [0, 31, 32, 999], 2: list(range(5, 700, 7))}
    bitmask = allocate_bitmask(2, vocab)
    set_allowed(bitmask[0], allowed[0])
    set_allowed(bitmask[1], allowed[2])
    out = apply_bitmask(logits, bitmask, [0, 2])
    for row in (1, 3):
        assert torch.equal(out[row], logits[row])
    for row, toks in allowed.items():
        finite = torch.isfinite(out[row]).nonzero()[:, 0].tolist()
        assert finite == toks
        assert torch.equal(out[row, toks], logits[row, toks])
    everything = apply_bitmask(logits, torch.cat([bitmask, bitmask]), [0, 1, 2, 3])
    assert torch.isfinite(everything[1]).nonzero()[:, 0].tolist() == allowed[2]  # rows [b0, b1, b0, b1]


@pytest.mark.engine  # sampling statistics over many draws: seconds, not the unit tier's inner loop
def test_a_masked_row_draws_from_the_allowed_tokens_with_the_same_noise():
    from batchjob.engine.constraints import allocate_bitmask, set_allowed
    from batchjob.engine.sampler import apply_bitmask

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(2))
    every = allocate_bitmask(1, 300)
    set_allowed(every[0], list(range(300)))
    some = allocate_bitmask(1, 300)
    set_allowed(some[0], [3, 50, 120])
    p = [SamplingParams(seed=4)]
    for pos in range(50):
        free = sample(logits, p, [7], [pos])
        assert sample(apply_bitmask(logits, every, [0]), p, [7], [pos]) == free
        tok = sample(apply_bitmask(logits, some, [0]), p, [7], [pos])[0]
        assert tok in (3, 50, 120)
        if free[0] in (3, 50, 120):  # the same Gumbel draw: an allowed winner still wins
            assert tok == free[0]


def test_top_logprobs_are_the_log_softmax_top_k_plus_the_sampled_token():
    from batchjob.engine.sampler import top_logprobs

    logits = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    lp = logits.log_softmax(-1)
    worst = lp[1].argmin().item()
    out = top_logprobs(logits, [0, 1], [3, 2], [lp[0].argmax().item(), worst])
    values, ids = lp[0].topk(3)
    assert out[0] == list(zip(ids.tolist(), values.tolist(), strict=True))
    assert len(out[1]) == 3 and out[1][-1] == (worst, lp[1, worst].item())


def test_top_logprobs_list_tied_tokens_by_id_and_take_the_lowest_across_the_kth_place():
    """Tokens of equal log-probability come lowest id first, and where they tie across the K-th place the
    lowest ids are listed: topk left them in any order (a tiny llama whose head rows repeat listed (202, 199)
    at one position, (199, 202) at another) and took either. Ties in pairs, and in fours (past the few extra
    tokens asked of topk: looked up)."""
    from batchjob.engine.sampler import top_logprobs

    logits = torch.randn(8, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for a in range(3, 450, 7):  # token a + 3 ties token a everywhere
        logits[:, a + 3] = logits[:, a]
    logits[4:, [40, 41, 700, 999]] = 9.0  # the best four tie
    lp = logits.log_softmax(-1)
    ks = [5, 10, 20, 40, 1, 2, 3, 5]
    out = top_logprobs(logits, list(range(8)), ks, [0] * 8)
    ranked = [sorted(enumerate(row), key=lambda p: (-p[1], p[0])) for row in lp.tolist()]
    assert [i for i, k in enumerate(ks) if out[i][:k] != ranked[i][:k]] == []
    assert [t for t, _ in out[5][:2]] == [40, 41]


@pytest.mark.engine  # sampling statistics over many seeds: seconds, not the unit tier's inner loop
def test_seeds_of_any_size_sample_by_their_value_mod_2_64():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5))

    def draws(seed, **kw):
        return [sample(logits, [SamplingParams(seed=seed, **kw)], [7], [pos])[0] for pos in range(40)]

    assert draws(2**64 + 9) == draws(9) and draws(2**200 + 9) == draws(9)  # what used to crash
    # above 2**63 the seed's 64 bits reach the noise as they are: not folded onto a smaller seed
    assert len({tuple(draws(s)) for s in (2**63 + 9, 2**64 - 1, 9, 2**32 + 9)}) == 4
    assert draws(3, top_k=10**30) == draws(3)  # a top_k beyond the vocabulary keeps every token


def test_the_draws_of_seeds_in_range_are_unchanged():
    # draws recorded before seeds were mapped: resume exactness, and every job's outputs, rest on them
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(seed=5), SamplingParams(seed=2**62 + 1)]
    got = [sample(logits, params, [7, 7], [p, p]) for p in range(6)]
    assert got == [[39, 355], [157, 164], [50, 157], [214, 67], [106, 181], [91, 117]]
