"""The batched sampler: filters behave, noise is a pure function of (seed, key, position)."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.sampler import sample, uniform_noise
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
