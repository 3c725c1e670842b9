"""Prefill-only tasks (engine/tasks/) on tiny random models, against the references people use:
sentence-transformers ``encode`` for embeddings, HF ``forward`` at batch size 1 for classifier logits and
token log-probabilities. float64: equal to 1e-12; float32: to 1e-5 absolute. Rows of mixed lengths go in
one forward, long ones in chunks, and score requests sharing a prompt reuse its KV blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.errors import ConfigError
from tests.task_models import MAX_LEN, make_classifier, make_embedder
from tests.tiers import engine_fixture
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(600)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "0 1 2",
    "This product is great, I love it! Terrible quality, it broke after a day. " * 3,
    "Classify the sentiment of the review as positive, negative or neutral.",
    "!",
    "Batch inference over a large dataset of prompts writes answers to Parquet files. " * 2,
]
TOL = {"float64": 1e-12, "float32": 1e-5}

# (family, sentence-transformers pooling): an encoder with mean and one with CLS pooling (XLM-RoBERTa's
# positions start after its padding index), ModernBERT and a bidirectional Gemma-3 (global and windowed
# layers, both ways), and a causal decoder embedder with last-token pooling.
EMBEDDERS = [
    ("bert", "mean"),
    ("xlm-roberta", "cls"),
    ("modernbert", "mean"),
    ("gemma3", "mean"),  # EmbeddingGemma: a decoder made an encoder, its windows both ways too
    ("qwen3", "lasttoken"),
]


@engine_fixture(scope="module")
def embedders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedders")
    return {f: make_embedder(root / f, f, pooling) for f, pooling in EMBEDDERS}


@engine_fixture(scope="module")
def classifiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "bert": make_classifier(root / "bert", "bert", 3),
        "xlm-roberta": make_classifier(root / "xlmr", "xlm-roberta", 3),
        "qwen2": make_classifier(root / "qwen2", "qwen2", 1),  # a reward model: one output
        "modernbert": make_classifier(root / "modernbert", "modernbert", 3),  # its head at the first token
        "modernbert-mean": make_classifier(root / "mb-mean", "modernbert", 2, classifier_pooling="mean"),
    }


@engine_fixture(scope="module")
def causal_lm(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lm") / "llama", "llama")


def _st_encode(folder, dtype, **kw):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    st.to(getattr(torch, dtype))
    return st.encode(TEXTS, convert_to_numpy=True, **kw)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", [f for f, _ in EMBEDDERS])
def test_embed_equals_sentence_transformers(embedders, family, dtype):
    ref = _st_encode(embedders[family], dtype)
    # The decoder's rows go in chunks of 16 tokens; an encoder's rows are never split, and all seven go in
    # one forward of 256 tokens.
    budget = 16 if family == "qwen3" else 256
    eng = Engine.from_pretrained(
        str(embedders[family]), task="embed", device="cpu", dtype=dtype, max_num_batched_tokens=budget
    )
    outs = eng.embed(TEXTS)
    assert [o.error for o in outs] == [None] * len(TEXTS)
    got = np.stack([o.embedding for o in outs])
    assert got.dtype == np.dtype(dtype)
    err = float(np.abs(got - ref).max())
    print(f"{family} {dtype}: max |ours - sentence-transformers| = {err:.3g}")
    assert err <= TOL[dtype]
    if family == "qwen3":
        assert eng.stats.steps > 1 and eng.stats.batched_tokens == sum(len(eng.tokenize(t)) for t in TEXTS)
    else:
        assert eng.stats.steps == 1  # mixed lengths packed in one forward
    assert eng.block_manager.num_used_blocks == 0  # every block freed as its request finished


@pytest.mark.parametrize("backend", ["torch", "flex"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_encoder_on_each_bidirectional_backend(embedders, backend, dtype):
    """The torch reference and flex (dense in float64; in float32 its compiled kernel, where it compiles)
    attend an encoder's rows both ways, as the default cpu backend does."""
    folder = embedders["bert"]
    ref = _st_encode(folder, dtype)
    eng = Engine.from_pretrained(
        str(folder),
        task="embed",
        device="cpu",
        dtype=dtype,
        attention_backend=backend,
        max_num_batched_tokens=64,
    )
    assert eng.runner.attention.name == backend
    got = np.stack([o.embedding for o in eng.embed(TEXTS)])
    err = float(np.abs(got - ref).max())
    print(f"bert {backend} {dtype}: max |ours - sentence-transformers| = {err:.3g}")
    assert err <= TOL[dtype] and eng.stats.steps > 1


def test_embed_options_override_and_matryoshka(embedders):
    folder = embedders["bert"]
    ref = _st_encode(folder, "float64", truncate_dim=16, normalize_embeddings=True)
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", dimensions=16)
    got = np.stack([o.embedding for o in eng.embed(TEXTS)])
    assert got.shape == (len(TEXTS), 16)
    assert np.abs(got - ref).max() <= 1e-12
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0)
    # Options win over the folder's files: CLS pooling, no normalisation, is the first hidden state.
    from transformers import AutoModel

    eng = Engine.from_pretrained(
        str(folder), task="embed", device="cpu", dtype="float64", pooling="cls", normalize=False
    )
    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float64).eval()
    for text, out in zip(TEXTS, eng.embed(TEXTS), strict=True):
        with torch.no_grad():
            first = hf(torch.tensor([eng.tokenize(text)])).last_hidden_state[0, 0].numpy()
        assert np.abs(out.embedding - first).max() <= 1e-12


def test_embed_too_long_is_an_error_row_unless_truncated(embedders):
    folder = embedders["bert"]
    long = "The quick brown fox jumps over the lazy dog. " * 40
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64")
    assert eng.prefill_limit == MAX_LEN
    ok, bad = eng.embed([TEXTS[0], long])
    assert ok.error is None and bad.finish_reason == "error" and bad.embedding is None
    assert f"longer than the model's limit of {MAX_LEN} tokens" in bad.error and "truncate" in bad.error
    eng = Engine.from_pretrained(str(folder), task="embed", device="cpu", dtype="float64", truncate=True)
    (cut,) = eng.embed([long])
    ref = _st_encode_one(folder, long)
    assert (
        cut.error is None and np.abs(cut.embedding - ref).max() <= 1e-12
    )  # cut as sentence-transformers cuts


def _st_encode_one(folder, text):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    st.to(torch.float64)
    return st.encode([text], convert_to_numpy=True)[0]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen2", "modernbert", "modernbert-mean"])
def test_classify_equals_hf_forward(classifiers, family, dtype):
    from transformers import AutoModelForSequenceClassification

    folder = classifiers[family]
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    eng = Engine.from_pretrained(
        str(folder), task="classify", device="cpu", dtype=dtype, max_num_batched_tokens=16
    )
    outs = eng.classify(TEXTS)
    err = 0.0
    for text, out in zip(TEXTS, outs, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([eng.tokenize(text)])).logits[0].numpy()
        assert out.error is None
        err = max(err, float(np.abs(out.logits - ref).max()))
        if ref.shape[0] == 1:
            assert out.score == pytest.approx(float(ref[0]), abs=TOL[dtype]) and out.label is None
        else:
            assert out.label == f"L{int(np.argmax(ref))}"
            assert np.abs(out.probs - torch.softmax(torch.from_numpy(ref), 0).numpy()).max() <= TOL[dtype]
    print(f"{family} {dtype}: max |ours - HF logits| = {err:.3g}")
    assert err <= TOL[dtype]
    assert eng.block_manager.num_used_blocks == 0


def test_a_decoder_head_reads_the_last_token_that_is_no_pad_as_transformers_does(classifiers):
    """A reward model whose pad token is its EOS: a text ending in it (or holding it) is read at its last
    token that is not the pad token, the position transformers' head reads (and trained it on)."""
    from transformers import AutoModelForSequenceClassification

    folder = classifiers["qwen2"]
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float64).eval()
    pad = hf.config.pad_token_id
    eng = Engine.from_pretrained(
        str(folder), task="classify", device="cpu", dtype="float64", max_num_batched_tokens=8
    )
    text = eng.tokenize("the quick brown fox jumps")
    rows = [text + [pad], text + [pad, pad, pad], text[:3] + [pad] + text[3:], [pad, pad], text]
    for ids, out in zip(rows, eng.classify(rows), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        assert out.error is None and out.score == pytest.approx(float(ref[0]), abs=TOL["float64"]), ids
    assert eng.classify([text + [pad]])[0].score == pytest.approx(eng.classify([text])[0].score, abs=1e-12)


def _hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """log P(ids[p + 1] | ids[: p + 1]) for every p, from HF's forward at batch size 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_score_equals_hf_forward(causal_lm, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(causal_lm), dtype=getattr(torch, dtype)).eval()
    # 16 tokens a step: the long texts are scored in chunks, several texts share a forward.
    eng = Engine.from_pretrained(
        str(causal_lm), task="score", device="cpu", dtype=dtype, max_num_batched_tokens=16
    )
    outs = eng.score(TEXTS, token_logprobs=True)
    err = 0.0
    for text, out in zip(TEXTS, outs, strict=True):
        ids = eng.tokenize(text)
        if len(ids) < 2:
            assert out.error is not None and "nothing to score" in out.error
            continue
        ref = _hf_logprobs(hf, ids)
        assert out.num_scored_tokens == len(ids) - 1 == len(out.token_logprobs)
        err = max(err, float(np.abs(np.array(out.token_logprobs) - ref).max()))
        assert out.logprob == pytest.approx(float(ref.sum()), abs=TOL[dtype] * len(ids))
        assert out.perplexity == pytest.approx(np.exp(-out.logprob / out.num_scored_tokens))
    print(f"score {dtype}: max |ours - HF token log-probability| = {err:.3g}")
    assert err <= TOL[dtype]
    assert eng.block_manager.num_used_blocks == 0


def test_score_in_bf16_takes_the_log_softmax_in_float32(causal_lm):
    """bf16 logits: each token's log-probability is computed in float32, as generate's are (it was computed
    in bf16, whose rounding moved a value by up to 0.025 from the float32 one of the same logits)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(causal_lm), dtype=torch.bfloat16).eval()
    eng = Engine.from_pretrained(str(causal_lm), task="score", device="cpu", dtype="bfloat16")
    text = TEXTS[0] + " " + TEXTS[1]
    ids = eng.tokenize(text)
    (out,) = eng.score([text], token_logprobs=True)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    want = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(out.token_logprobs)
    # (our forward's bf16 logits differ from HF's in their last bits: 0.0016 at most here, 0.024 before)
    assert float((got - want.double()).abs().max()) <= 5e-3
    assert not torch.equal(got, got.bfloat16().double())  # not bf16 values


def test_conditional_score_reuses_the_prompt(causal_lm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(causal_lm), dtype=torch.float64).eval()
    eng = Engine.from_pretrained(str(causal_lm), task="score", device="cpu", dtype="float64", block_size=4)
    prompt = "Classify the sentiment of the review as positive, negative or neutral. The review:"
    answers = [" positive", " negative", " neutral"]
    outs = eng.score([prompt] * 3, answers, token_logprobs=True)
    p = eng.tokenize(prompt)
    for answer, out in zip(answers, outs, strict=True):
        c = eng.tokenize(answer, special_tokens=False)
        ref = _hf_logprobs(hf, p + c)[len(p) - 1 :]  # only the continuation's tokens
        assert out.num_scored_tokens == len(c)
        assert np.abs(np.array(out.token_logprobs) - ref).max() <= 1e-12
        assert out.logprob == pytest.approx(float(ref.sum()), abs=1e-12)
    # an empty prompt: the continuation's first token has nothing before it (it was left out, or 0.0 scored)
    empty = eng.score([""], [" positive"])[0]
    assert empty.error is not None and "empty prompt" in empty.error
    # The three share the prompt: its full blocks were computed once and then taken from the prefix cache
    # (up to the block holding the prompt's last token, whose row predicts the continuation's first).
    assert eng.stats.cached_prompt_tokens >= 2 * ((len(p) - 1) // 4) * 4 > 0


def test_a_cut_scored_text_keeps_its_first_tokens_on_either_truncation_side(causal_lm, tmp_path):
    """--truncate on a prompt and a scored text longer than the limit scores the text's first tokens, as the
    one cut of prompt + text from the end keeps them, whatever side the tokenizer cuts a text alone on. A
    tokenizer with truncation_side "left" cut the text alone first, keeping its last tokens, and the joint
    cut then scored tokens 28-55 of 60, from its middle (-165.005 where the first 27 give -165.690)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    left = tmp_path / "left"
    shutil.copytree(causal_lm, left)
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    hf = AutoModelForCausalLM.from_pretrained(str(causal_lm), dtype=torch.float64).eval()
    prompt, text = "The capital of France is", " " + " ".join(str(i) for i in range(40))
    for folder in (causal_lm, left):
        eng = Engine.from_pretrained(
            str(folder), task="score", device="cpu", dtype="float64", truncate=True, max_model_len=32
        )
        p, c = eng.tokenize(prompt), eng.tokenizer(text, add_special_tokens=False).input_ids
        assert len(p) + len(c) > 32
        [out] = eng.score([prompt], [text], token_logprobs=True)
        ref = _hf_logprobs(hf, (p + c)[:32])[len(p) - 1 :]  # the text's first 32 - len(p) tokens
        assert out.num_scored_tokens == 32 - len(p)
        assert np.abs(np.array(out.token_logprobs) - ref).max() <= 1e-12, folder.name


def test_refusals(embedders, causal_lm):
    folder = str(embedders["bert"])
    # An encoder attends both ways: a backend without it is refused by name, and so is generation.
    from batchjob.engine.attention.registry import choose_attention
    from batchjob.engine.support import attention_features

    assert attention_features(Engine.from_pretrained(folder, task="embed", device="cpu").model.config) == {
        "bidirectional"
    }
    for backend in ("flash", "varlen"):  # flash-attn's kernels are causal only
        with pytest.raises(ConfigError, match="cannot run here: it does not implement bidirectional"):
            choose_attention(
                torch.device("cuda"), torch.bfloat16, frozenset({"bidirectional"}), backend=backend
            )
    with pytest.raises(ConfigError, match="can embed or classify"):
        Engine.from_pretrained(folder, task="score", device="cpu")
    lm = Engine.from_pretrained(str(causal_lm), task="score", device="cpu")
    with pytest.raises(ConfigError, match="embed\\(\\) needs an engine built with task='embed'"):
        lm.embed(TEXTS)
    with pytest.raises(ConfigError, match="generate\\(\\) needs an engine built with task='generate'"):
        lm.generate(TEXTS)
    with pytest.raises(
        ConfigError, match="pooling, normalize, dimensions and prompt_name are options of task embed"
    ):
        Engine.from_pretrained(str(causal_lm), task="score", device="cpu", pooling="mean")
    with pytest.raises(ConfigError, match="task must be one of generate, embed, classify, score"):
        Engine.from_pretrained(str(causal_lm), task="rerank", device="cpu")


def test_task_inputs_follow_generates_rule_or_are_refused_by_index(embedders, classifiers, causal_lm):
    """embed/classify/score take their inputs by generate()'s rule: one text is one input (it was one an
    input per character: 11 embeddings for "hello world"), token ids are integers (5.7 ran as 5, True as 1,
    b"hi" as the ids 104 and 105), anything else is refused naming its index (None, a dict, half a UTF-16
    pair raised a TypeError or ValueError), all before any is added, so the engine stays idle."""
    emb = Engine.from_pretrained(str(embedders["bert"]), task="embed", device="cpu", dtype="float64")
    cls = Engine.from_pretrained(str(classifiers["bert"]), task="classify", device="cpu", dtype="float64")
    lm = Engine.from_pretrained(str(causal_lm), task="score", device="cpu", dtype="float64")
    [one] = emb.embed("hello world")
    assert np.array_equal(one.embedding, emb.embed(["hello world"])[0].embedding)
    assert [o.label for o in cls.classify("hello world")] == [cls.classify(["hello world"])[0].label]
    [scored] = lm.score("The capital is", " Paris")  # it said "got 6 continuations for 14 prompts"
    assert scored.logprob == lm.score(["The capital is"], [" Paris"])[0].logprob
    refused = {
        "input 1: token 0 is 5.7 (float), not an integer token id": lambda: emb.embed([[5, 6], [5.7, 6.2]]),
        "input 0: token 0 is True (bool), not an integer token id": lambda: emb.embed([[True, 2]]),
        "input 0 is bytes: give a text or a list of token ids": lambda: emb.embed([b"hi"]),
        "input 1: character 1 (\\ud800) is half a UTF-16 pair": lambda: emb.embed(["ok", "a\ud800b"]),
        "got the integer 5 as an input": lambda: emb.embed([5, 6]),
        "input 0 is NoneType: give a text or a list of token ids": lambda: cls.classify([None]),
        "input 0 is dict: give a text or a list of token ids": lambda: cls.classify([{"role": "user"}]),
        "continuation 1 is NoneType": lambda: lm.score(["a b", "c d"], [" e", None]),
        "prompt 0: token 0 is 2.5 (float)": lambda: lm.score([[2.5, 3]]),
        "request 'r''s continuation: token 0 is 1.0 (float)": lambda: lm.add_request(
            "r", [5, 6], continuation_ids=[1.0]
        ),
    }
    for message, call in refused.items():
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value), str(e.value)
    assert not (emb.has_unfinished() or cls.has_unfinished() or lm.has_unfinished())


def test_incremental_api_and_snapshot(causal_lm):
    """The job loop's way: add_request and step(); an unfinished score request snapshots its
    continuation, and re-added from the snapshot it gives the same result."""
    eng = Engine.from_pretrained(
        str(causal_lm), task="score", device="cpu", dtype="float64", max_num_batched_tokens=8
    )
    p = eng.tokenize(TEXTS[1])
    c = eng.tokenize(TEXTS[0], special_tokens=False)
    eng.add_request("row-1", p, continuation_ids=c, token_logprobs=True)
    assert eng.step() == []  # 8 of its tokens computed
    (state,) = eng.snapshot()
    assert state.prompt_ids == p and state.continuation_ids == c and state.token_logprobs
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (first,) = outs
    eng.add_request(
        state.request_id,
        state.prompt_ids,
        continuation_ids=state.continuation_ids,
        token_logprobs=state.token_logprobs,
    )
    (again,) = [o for _ in range(20) for o in eng.step()]
    assert again.request_id == "row-1" and again.logprob == first.logprob
    assert again.token_logprobs == first.token_logprobs and again.num_scored_tokens == len(c)


def test_kv_pool_sized_for_the_task_limit(embedders):
    """A decoder embedder's pool needs room for one text of its sentence-transformers limit, not for the
    model's whole context: 18 blocks of 16 tokens hold 96 tokens, not the 512 of its positions."""
    eng = Engine.from_pretrained(
        str(embedders["qwen3"]), task="embed", device="cpu", dtype="float32", kv_memory_gb=0.00015
    )
    assert eng.block_manager.num_blocks * 16 < 512 and eng.prefill_limit == MAX_LEN
    assert all(o.embedding is not None for o in eng.embed(TEXTS))


@pytest.mark.parametrize("task", ["embed", "classify", "score"])
def test_bench_task(embedders, classifiers, causal_lm, task, tmp_path):
    """``batchjob bench --task``: ours and its anchors on the same docstring texts, ratios, the JSON file."""
    import json

    from click.testing import CliRunner

    from batchjob.cli import main

    model = {"embed": embedders["bert"], "classify": classifiers["bert"], "score": causal_lm}[task]
    out = tmp_path / "bench.json"
    args = ["bench", "--task", task, "--model", str(model), "--num-requests", "6", "--text-tokens", "5,60"]
    args += ["--st-batch-sizes", "4", "--hf-batch-size", "4", "--device", "cpu", "--threads", "1"]
    repeat = 2 if task == "embed" else 1  # rounds: each figure the fastest of its runs
    result = CliRunner().invoke(main, [*args, "--json", str(out), "--repeat", str(repeat)])
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    names = [r["name"] for r in body["results"]]
    expected = ["ours", "st-encode batch=32", "st-encode batch=4"] if task == "embed" else ["ours"]
    assert names == [*expected, "hf-forward batch=4"]
    assert body["texts"] == 6 and all(
        r["tokens"] == body["results"][0]["tokens"] > 0 for r in body["results"]
    )
    assert body["repeat"] == repeat and all(
        len(r["walls"]) == repeat and r["seconds"] == min(r["walls"]) for r in body["results"]
    )
    assert ("every run's seconds" in result.output) == (repeat > 1)
    assert f"task {task}: 6 texts" in result.output
    if task == "embed":
        assert "ours vs sentence-transformers encode:" in result.output


def test_modernbert_windows_both_ways_only_on_backends_that_compute_them(embedders):
    """ModernBERT's local layers attend within a window on both sides: the default (cpu) and torch backends
    compute it (the tests above); flex does not, and is refused by name rather than run without it."""
    folder = str(embedders["modernbert"])
    eng = Engine.from_pretrained(folder, task="embed", device="cpu", dtype="float64")
    assert eng.runner.attention.name == "cpu_kernel" and "bidirectional_window" in eng.runner.features
    with pytest.raises(ConfigError, match="bidirectional_window"):
        Engine.from_pretrained(folder, task="embed", device="cpu", dtype="float64", attention_backend="flex")


def _task_values(out) -> tuple:
    """A task output's values as (dtype, bytes) pairs: equal only when bit for bit equal."""
    return tuple(
        None if v is None else (np.asarray(v).dtype.str, np.asarray(v).tobytes())
        for v in (out.embedding, out.logits, out.score, out.logprob, out.token_logprobs, out.error)
    )


@pytest.mark.parametrize("task", ["score", "embed", "classify"])
def test_task_floats_never_depend_on_what_shares_the_step_or_the_cache(
    causal_lm, embedders, classifiers, task
):
    """float32, bit for bit: every row alone in a fresh engine, and all together in one engine whose small
    budget packs them beside each other in chunks and whose prefix cache serves the shared prompts (and the
    repeated texts), write the same floats. This is what lets a resumed task job write what an
    uninterrupted one did (the grid of chunks in scheduler.py; the engine's chunks were cut where the
    step's budget ran out before, and one-token rows went a separate way: up to 19 of 80 rows then
    differed in their last bits)."""
    folder = {"score": causal_lm, "embed": embedders["qwen3"], "classify": classifiers["qwen2"]}[task]
    prompt = "Classify the sentiment of the review as positive, negative or neutral. The review: "
    texts = [prompt + "great", TEXTS[3], prompt + "great", TEXTS[0], TEXTS[3], prompt + "terrible, it broke"]
    conts = [" positive", " negative", " neutral", " positive and more", " ok", " negative"]

    def run(indices, **kw):
        kw = {"block_size": 4, "max_num_batched_tokens": 13, **kw}
        eng = Engine.from_pretrained(str(folder), task=task, device="cpu", dtype="float32", **kw)
        if task == "score":
            outs = eng.score([prompt] * len(indices), [conts[i] for i in indices], token_logprobs=True)
        else:
            outs = getattr(eng, task)([texts[i] for i in indices])
        return [_task_values(o) for o in outs], eng

    together, eng = run(range(6), max_num_seqs=3)
    assert eng.stats.cached_prompt_tokens > 0, "the shared prompts were meant to come from the cache"
    for i in range(6):
        assert run([i])[0] == [together[i]], f"row {i} differs alone"
    assert run(range(6), max_num_seqs=3, enable_prefix_caching=False)[0] == together
    # And right: each row in one chunk, alone, agrees to float32 rounding. (A row whose chunk ended one
    # token before its end once took prompt-lookup drafts as if it were decoding, and its embedding came
    # from the wrong position.)
    whole = run(range(6), max_num_batched_tokens=512, max_num_seqs=1)[0]
    for got, want in zip(together, whole, strict=True):
        for g, w in zip(got, want, strict=True):
            if g is not None:
                g, w = (np.frombuffer(v[1], dtype=v[0]) for v in (g, w))
                assert np.allclose(g, w, rtol=1e-4, atol=1e-5), np.abs(g - w).max()


def test_a_pad_token_inside_a_roberta_style_text_is_refused(classifiers):
    """transformers gives it the padding position and the tokens after it positions one lower; this engine
    counts every token, so such a row is an error, never logits computed at other positions."""
    eng = Engine.from_pretrained(
        str(classifiers["xlm-roberta"]), task="classify", device="cpu", dtype="float64"
    )
    pad = eng.model.config.pad_token_id
    text = eng.tokenize("the quick brown fox")
    bad, good = eng.classify([text[:2] + [pad] + text[2:], text])
    assert bad.finish_reason == "error" and bad.error.startswith(
        f"the text holds the pad token (id {pad}, at token 2)"
    )
    assert good.error is None
