"""Choices on a bigram model whose distributions are set by hand: the answer greedy picks, each label's
log-probability where the model puts almost all its mass on going on, a label that cannot be scored, and the
answer's own token log-probabilities where it is not the token walk's."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchjob import Engine, SamplingParams
from tests.tiny_models import make_choice_bigram

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """After 'x': 'a' 0.5, 'b' 0.3, 'd' 0.2; after 'a': 'c' 0.3, 'd' 0.7; after 'c': '!' all but ~1e-41;
    after 'b': 'c' all but ~1e-41 (``make_choice_bigram``)."""
    folder = tmp_path_factory.mktemp("bigram")
    tok, x = make_choice_bigram(folder, 0.3)
    return folder, tok, x


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def test_greedy_answers_the_most_likely_label_when_a_longer_one_holds_nearly_all_of_a_shorter_ones_mass(
    bigram,
):
    """'ac' ends where 'ac!' goes on with all but e^-100 of the mass: 1 - P('!') rounded to 0, 'ac' read -inf,
    and greedy fell back to the token walk, answering 'ac!' (0.15) over 'b' (0.3, its own choice_probs 0.67).
    'ac' keeps its true small probability, summed in log space over the tokens that do not go on."""
    folder, tok, x = bigram
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    [out] = engine.generate([[x]], SamplingParams(temperature=0, choices=["ac", "ac!", "b"]))
    assert out.text == "b" and out.finish_reason == "stop"
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float64)
    with torch.no_grad():
        lp = hf(torch.tensor([[x, *_ids(tok, "ac")]])).logits[0].log_softmax(-1)
    a, c = _ids(tok, "ac")
    rest = lp[2].clone()
    rest[_ids(tok, "!")[0]] = -math.inf
    want = lp[0, a].item() + lp[1, c].item() + torch.logsumexp(rest, 0).item()
    assert want < -90
    assert out.choice_logprobs["ac"] == pytest.approx(want, abs=1e-8)
    assert out.choice_logprobs["b"] == pytest.approx(math.log(0.3), abs=1e-5)
    assert max(out.choice_probs, key=out.choice_probs.get) == "b"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_label_that_does_not_fit_the_context_makes_the_row_an_error(bigram, temperature):
    """'a' is answered; the scoring requests of 'b c b c''s nodes past its 3rd token do not fit a context of 16
    after 12 prompt tokens: its log-probability was NaN, written without a word, beside a finished answer."""
    folder, tok, x = bigram
    engine = Engine.from_pretrained(
        str(folder), dtype="float64", device="cpu", max_model_len=16, block_size=4
    )
    params = SamplingParams(temperature=temperature, seed=1, choices=["a", "b c b c"])
    [out] = engine.generate([[x] * 12], params)
    assert out.finish_reason == "error" and out.choice_logprobs is None and out.choice_probs is None
    assert out.error == (
        "the choice 'b c b c' could not be scored: the prompt's 12 tokens and the choice's first 4 reach the "
        "end of the model's context; shorten the prompt or raise --max-model-len"
    )
    [fits] = engine.generate([[x] * 8], params)  # 8 + 6: every node is scored
    assert fits.error is None and all(math.isfinite(v) for v in fits.choice_logprobs.values())


def _hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float64)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


@pytest.mark.parametrize(
    ("labels", "want"),
    # 'ac' 0.15, 'bc' 0.3, 'bc!' 0.3: the walk takes 'a' (0.5 against 0.3) and greedy answers 'b...';
    # 'a' 0.35 against 'ac' 0.15: the walk takes 'c' (the stop token's logit is 0), greedy answers 'a'.
    [(["ac", "bc"], "bc"), (["ac", "bc!"], "bc!"), (["a", "ac"], "a")],
)
def test_logprobs_follow_the_answers_own_tokens(bigram, labels, want):
    """Greedy answers the most likely whole label, which need not be the token walk's: the logprobs were the
    walk's ('c' of 'bc' read -1.2, P('c' | 'a'), with 'a''s top tokens; 'bc!' had 2 entries for 3 tokens;
    'a' had 2, the walk's 'a' and 'c'). Now one per answer token, the model's own top K at it."""
    folder, tok, x = bigram
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    [out] = engine.generate([[x]], SamplingParams(temperature=0, choices=labels, logprobs=2))
    assert out.text == want and out.token_ids == _ids(tok, want)
    assert len(out.logprobs) == len(out.token_ids)
    lp = _hf_logprobs(folder, [x, *out.token_ids])
    for i, (t, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        values, ids = lp[i].topk(2)  # the second of 'bc''s 'c' is a tie among the other tokens
        assert top[0][0] == ids[0].item() and len(top) == 2 + (t not in [u for u, _ in top[:2]])
        assert [v for _, v in top[:2]] == pytest.approx(values.tolist(), abs=1e-8)
        assert [v for _, v in top] == pytest.approx([lp[i, u].item() for u, _ in top], abs=1e-8)
        assert t in [u for u, _ in top]


def test_a_label_holding_a_special_token_is_the_request_s_error(bigram):
    """The label's tokens held the token itself: 'a<|im_end|>' was the model's 'a' then its end and 'a' beside
    it 'a' then no end (so 'a' and its end, the model's own answer, split across two labels); a label that is
    the end-of-sequence text alone read the model's ending with no answer, written as the label."""
    folder, tok, x = bigram
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    end = tok.eos_token
    for labels in (["a", f"a{end}", "b"], ["a", "b", end]):
        [out] = engine.generate([[x]], SamplingParams(temperature=0, choices=labels))
        assert out.finish_reason == "error" and out.choice_logprobs is None, (labels, out.text)
        label = labels[1] if labels[1] != "b" else end
        assert out.error == (
            f"the choice {label!r} holds the special token {end!r}, which the output text leaves out: it would "
            "be scored as that token (the end of the answer, for an end-of-sequence token), not as its text; "
            "spell the label without it"
        )
    [fine] = engine.generate([[x]], SamplingParams(temperature=0, choices=["a", "b"]))
    assert fine.error is None and fine.text == "a"


def _filtered(probs: dict[str, float], temperature: float, top_k: int, top_p: float, min_p: float):
    """The labels' distribution a draw must follow, by the sampler's rules written out over labels: the
    probabilities to the power 1 / temperature; the top k (ties of the k-th kept); the fewest, best first,
    whose mass reaches top_p; those at least min_p times the best. Renormalised after each."""

    def norm(w: dict[str, float]) -> dict[str, float]:
        total = sum(w.values())
        return {k: v / total for k, v in w.items()}

    w = norm({k: p ** (1 / temperature) for k, p in probs.items()})
    order = sorted(w, key=w.get, reverse=True)
    if top_k:
        w = norm({k: w[k] for k in order if w[k] >= w[order[min(top_k, len(order)) - 1]]})
    kept, mass = {}, 0.0
    for k in (k for k in order if k in w):
        if kept and mass >= top_p:
            break
        kept[k], mass = w[k], mass + w[k]
    w = norm(kept)
    best = max(w.values())
    return norm({k: v for k, v in w.items() if v >= min_p * best})


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (2.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.0, 2, 1.0, 0.0),
        (1.0, 0, 0.5, 0.0),
        (1.5, 0, 1.0, 0.6),
    ],
)
def test_sampled_labels_follow_the_whole_labels_probabilities(bigram, temperature, top_k, top_p, min_p):
    """'ac' 0.15, 'bc' 0.3, 'd' 0.2 (choice_probs 0.23, 0.46, 0.31): the answer was the token walk's, which
    picks each token among the trie's children, 'a' at 0.5, so 'ac' came 0.5 of the time (1,503 of 3,000
    at temperature 1) and always at top-k 1, where 'bc' is the best label. A label is drawn from the
    labels' whole probabilities, at the row's temperature, top-k, top-p and min-p."""
    folder, _tok, x = bigram
    engine = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=5,
        n=3000,
        choices=["ac", "bc", "d"],
    )
    outs = engine.generate([[x]], params)
    want = _filtered(outs[0].choice_probs, temperature, top_k, top_p, min_p)
    counts = {label: sum(o.text == label for o in outs) for label in params.choices}
    for label, count in counts.items():
        p = want.get(label, 0.0)
        assert abs(count - 3000 * p) <= 5 * math.sqrt(3000 * p * (1 - p)) + 1, (counts, want)
    for o in outs:  # the answer's tokens are the label's
        assert o.token_ids == _ids(_tok, o.text) and o.finish_reason == "stop"


def test_a_sampled_label_is_the_same_alone_in_a_crowd_preempted_and_resumed(bigram):
    """A row's label is a function of its seed, key and the labels' log-probabilities: the same alone, among
    other rows in a pool that preempts, and resumed after any first token of the walk (the walk's tokens
    were the answer: resumed after 'a', every row answered 'ac')."""
    folder, tok, x = bigram
    params = SamplingParams(temperature=1.0, seed=3, choices=["ac", "bc", "d"])
    prompt = [x] * 9
    ids = [f"row{i}" for i in range(40)]

    def run(engine: Engine, output_ids=None, crowd: int = 0) -> dict[str, str]:
        for i in range(crowd):
            engine.add_request(
                f"other{i}", [x] * 13, SamplingParams(max_new_tokens=24, ignore_eos=True, seed=i)
            )
        for rid in ids:
            engine.add_request(rid, prompt, params, output_ids=output_ids)
        texts = {}
        while engine.has_unfinished():
            texts |= {o.request_id: o.text for o in engine.step()}
        return {rid: texts[rid] for rid in ids}

    roomy = Engine.from_pretrained(str(folder), dtype="float64", device="cpu")
    alone = {}
    for rid in ids:
        roomy.add_request(rid, prompt, params)
        while roomy.has_unfinished():
            alone |= {o.request_id: o.text for o in roomy.step()}
    assert len(set(alone.values())) == 3, alone  # the rows do differ
    tight = Engine.from_pretrained(
        str(folder), dtype="float64", device="cpu", block_size=4, num_blocks=40, max_num_seqs=16
    )
    assert run(tight, crowd=12) == alone
    assert tight.stats.preemptions > 0
    for first in ("a", "b", "d"):
        assert run(roomy, output_ids=_ids(tok, first)) == alone, first
