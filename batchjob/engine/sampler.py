"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with counter-based noise.

The random draw for a request's token at output position ``p`` is a pure function of (seed, request key,
p): we hash those with the vocabulary index into uniform noise and take a Gumbel-max draw. So a request
samples the same tokens alone or in any crowd, after a preemption and after a restart, on CPU or GPU.
A constrained row is masked first (``apply_bitmask``) and then drawn the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from batchjob.sampling import SamplingParams

_M32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors holding 32-bit values (products stay below 2**63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(
    seeds: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, vocab: int
) -> torch.Tensor:
    """[R, vocab] float32 in (0, 1), determined by each row's (seed, key, position) and the column."""
    h = _mix32(seeds & _M32)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ keys)
    h = _mix32(h ^ positions)  # [R]
    cols = (torch.arange(vocab, device=h.device, dtype=torch.int64) * 0x9E3779B1) & _M32
    x = _mix32(_mix32(h[:, None] ^ cols[None, :]))
    # The top code's midpoint, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32 (a Gumbel draw of +inf, which
    # would win over any logit, a masked one too): it takes the largest float32 below 1 instead.
    return (((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def _as_int64(seed: int) -> int:
    """A seed in [0, 2**64) (``SamplingParams`` maps any seed there) as the int64 of the same 64 bits: the
    noise reads its low and high 32 bits, so seeds below 2**63 draw what they always drew."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: byte -> its bits, LSB first


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[C, W] int32 bitmask (bit t % 32 of word t // 32 allows token t) -> [C, vocab] bool on ``device``."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab].view(np.bool_))
    table = _BITS.to(device)
    packed = bitmask.to(device, non_blocking=True).view(torch.uint8).long()  # little-endian bytes
    return table[packed].view(bitmask.shape[0], -1)[:, :vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits`` with ``[rows[i], t]`` set to -inf wherever ``bitmask[i]`` does not allow token t."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, sub)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in at least float32 (float64 logits stay float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)


def top_logprobs(
    logits: torch.Tensor, rows: list[int], ks: list[int], tokens: list[int]
) -> list[list[tuple[int, float]]]:
    """For each row: the top-k log-probabilities of the model's own distribution (before temperature,
    filters or constraints), best first (ties by token id), then the sampled token's when it is not among
    them."""
    index = torch.tensor(rows, device=logits.device)
    lp = log_softmax(logits.index_select(0, index))
    chosen = lp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    out = ranked_top(lp, ks)
    for i, (top, tok) in enumerate(zip(out, tokens, strict=True)):
        if all(t != tok for t, _ in top):
            top.append((tok, chosen[i]))
    return out


_HEADROOM = 2  # tokens asked of topk past the k-th: those tied with it are among them, unless 3 or more tie


def ranked_top(lp: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """Each row's first ``ks[i]`` tokens of ``lp`` ([R, V] log-probabilities) by value, highest first, equal
    values by token id, lowest first. ``topk`` leaves equal values in any order and, where they straddle the
    k-th place, takes any of them (the same logits listed two tied tokens either way at two positions; bf16
    logits tie often). A few more are asked for, so the tokens tied with the k-th are among them; a row whose
    tie runs past them all has its tied tokens looked up."""
    kmax = min(max(ks, default=0) + _HEADROOM, lp.shape[-1])
    values, ids = lp.topk(kmax, dim=-1) if kmax > 0 else (lp[:, :0], lp[:, :0].long())
    vals, idl = values.tolist(), ids.tolist()
    # a tie across the k-th place that reaches the last token asked for: others may tie beyond it
    beyond = [i for i, k in enumerate(ks) if 0 < k < kmax < lp.shape[-1] and vals[i][-1] == vals[i][k - 1]]
    tied = _tied(lp, beyond, [vals[i][ks[i] - 1] for i in beyond])
    out = []
    for i, k in enumerate(ks):
        top = list(zip(idl[i], vals[i], strict=True))
        if any(a == b for a, b in zip(vals[i][:k], vals[i][1 : k + 1], strict=False)):  # else best first
            top.sort(key=lambda p: (-p[1], p[0]))
        if i in tied:
            edge = vals[i][k - 1]
            top = [p for p in top if p[1] > edge] + [(t, edge) for t in tied[i]]
        out.append(top[:k])
    return out


def _tied(lp: torch.Tensor, rows: list[int], edges: list[float]) -> dict[int, list[int]]:
    """The tokens of each of ``rows`` whose value is its ``edges`` value, lowest id first (one lookup)."""
    if not rows:
        return {}
    at = lp.index_select(0, torch.tensor(rows, device=lp.device))
    hits = (at == torch.tensor(edges, dtype=lp.dtype, device=lp.device)[:, None]).nonzero().tolist()
    out: dict[int, list[int]] = {r: [] for r in rows}
    for j, t in hits:  # row-major: each row's tokens ascending
        out[rows[j]].append(t)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's largest value (a NaN counts as the largest). On the
    CPU ``max(dim)`` returns the same indices (torch documents both as the first maximal one; checked on ties,
    NaNs and infinities in tests/engine/test_sampler.py) several times faster: over 16 rows of a 151,936-token
    vocabulary in bf16, 2.3 against 9.2 ms (argmax's reduction is not vectorised there), ~5% of a decode step
    at the Qwen2.5-0.5B shape."""
    if x.device.type == "cpu":
        return x.max(dim=-1).indices
    return x.argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [R, V], any float dtype
    params: list[SamplingParams],
    keys: list[int],
    positions: list[int],  # output position of the token being drawn
) -> list[int]:
    greedy = [p.greedy for p in params]
    if all(greedy):
        return argmax_rows(logits).tolist()

    device = logits.device
    out = argmax_rows(logits)
    rows = torch.tensor([i for i, g in enumerate(greedy) if not g], device=device)
    picked = rows.tolist()
    x = logits.index_select(0, rows).float()
    drawn = draw(x, [params[i] for i in picked], [keys[i] for i in picked], [positions[i] for i in picked])
    out[rows] = drawn
    return out.tolist()


def draw(
    x: torch.Tensor,  # [R, V] float logits of rows that sample (temperature > 0)
    sp: list[SamplingParams],
    keys: list[int],
    positions: list[int],
) -> torch.Tensor:
    """Each row's draw ([R] int64): its logits over its temperature, cut by its top-k, top-p and min-p, then
    Gumbel-max with the noise of its (seed, key, position). Token rows draw a token; a choice request draws
    its label here too, over the labels' whole log-probabilities (choices.py)."""
    device = x.device
    x = x / torch.tensor([p.temperature for p in sp], device=device, dtype=x.dtype)[:, None]

    if any(p.top_k > 0 or p.top_p < 1.0 for p in sp):
        sorted_x, order = x.sort(dim=-1, descending=True)
        vocab = x.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in sp], device=device)[:, None]
        drop = sorted_x < sorted_x.gather(1, top_k - 1)  # as HF and vLLM: the k-th value's ties stay
        top_p = torch.tensor([p.top_p for p in sp], device=device, dtype=x.dtype)[:, None]
        probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        # the fewest tokens whose mass reaches top_p (HF, vLLM); a row without top_p is never cut by the
        # cumulative sum's rounding past 1
        drop |= (before >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))

    if any(p.min_p > 0.0 for p in sp):
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in sp], device=device, dtype=x.dtype)[:, None]
        x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))

    seeds = torch.tensor([_as_int64(p.seed or 0) for p in sp], dtype=torch.int64, device=device)
    k = torch.tensor(keys, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    u = uniform_noise(seeds, k, pos, x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return argmax_rows(x + gumbel)
