"""LoRA adapters with the prefill-only tasks against PEFT in float64: ``score`` (a LoRA-tuned causal LM's
token log-probabilities from ``PeftModel``'s logits), ``embed`` (an encoder's and a decoder embedder's
``PeftModel`` hidden states, pooled as the folder says) and ``classify`` (a ``SEQ_CLS`` adapter with its
fine-tuned head in ``modules_to_save``: ``PeftModel``'s logits), each in a mixed batch of two adapters and
base rows; float32 bit for bit alone vs mixed; what is not built refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.errors import ConfigError, ModelNotFoundError
from tests.task_models import make_classifier, make_embedder
from tests.tiers import engine_fixture
from tests.tiny_models import make_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(600)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "This product is great, I love it! Terrible quality, it broke after a day. " * 2,
    "0 1 2",
    "Classify the sentiment of the review as positive, negative or neutral.",
    "Batch inference over a large dataset of prompts writes answers to Parquet files.",
]
NAMES = [None, "a", "b", "a", None, "b"]  # each text's adapter: two adapters and base rows in one batch
TARGETS = {  # two adapters per family: attention only, and attention with the MLP at another rank
    "decoder": (["q_proj", "v_proj"], ["k_proj", "o_proj", "gate_proj", "down_proj"]),
    "bert": (["query", "value"], ["key", "dense"]),  # "dense": BERT's pooler.dense too
    "xlm-roberta": (["query", "value"], ["key", "output.dense"]),  # (its classifier.dense is the head's)
}


def _peft_folder(base, out: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **config)).save_pretrained(str(out))
    return out


def _adapters(load, root: Path, kind: str, **config) -> dict[str, Path]:
    """Adapters "a" (r=4) and "b" (r=2, rsLoRA) made by PEFT on the model ``load()`` returns."""
    first, second = TARGETS[kind]
    return {
        "a": _peft_folder(load(), root / "a", 1, r=4, lora_alpha=8, target_modules=first, **config),
        "b": _peft_folder(
            load(), root / "b", 2, r=2, lora_alpha=3, use_rslora=True, target_modules=second, **config
        ),
    }


@engine_fixture(scope="module")
def scorer(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lm")
    base = make_model(root / "llama", "llama")
    return base, _adapters(lambda: AutoModelForCausalLM.from_pretrained(str(base)), root, "decoder")


@engine_fixture(scope="module")
def embedders(tmp_path_factory):
    from transformers import AutoModel

    out = {}
    for family, pooling, kind in (("bert", "mean", "bert"), ("qwen3", "lasttoken", "decoder")):
        root = tmp_path_factory.mktemp(family)
        base = make_embedder(root / family, family, pooling)
        load = lambda base=base: AutoModel.from_pretrained(str(base))  # noqa: E731
        out[family] = base, _adapters(load, root, kind, task_type="FEATURE_EXTRACTION")
    return out


@engine_fixture(scope="module")
def classifiers(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    out = {}
    for family, labels, kind in (
        ("bert", 3, "bert"),
        ("xlm-roberta", 3, "xlm-roberta"),
        ("qwen2", 1, "decoder"),
    ):
        root = tmp_path_factory.mktemp(family)
        base = make_classifier(root / family, family, labels)
        load = lambda base=base: AutoModelForSequenceClassification.from_pretrained(str(base))  # noqa: E731
        out[family] = base, _adapters(load, root, kind, task_type="SEQ_CLS")
    return out


def _peft(load, adapter: Path | None):
    model = load()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    return model.double().eval()


def test_score_under_adapters_equals_peft(scorer):
    from transformers import AutoModelForCausalLM

    base, folders = scorer
    paths = {k: str(v) for k, v in folders.items()}
    eng = Engine.from_pretrained(
        str(base), task="score", device="cpu", dtype="float64", max_num_batched_tokens=16, lora=paths
    )
    outs = eng.score(TEXTS, token_logprobs=True, adapters=NAMES)
    refs = {}
    for text, name, out in zip(TEXTS, NAMES, outs, strict=True):
        ids = eng.tokenize(text)
        model = _peft(lambda: AutoModelForCausalLM.from_pretrained(str(base)), folders.get(name or ""))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        ref = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
        assert out.error is None and out.num_scored_tokens == len(ids) - 1
        assert np.abs(np.array(out.token_logprobs) - ref).max() <= 1e-12, name
        assert out.logprob == pytest.approx(float(ref.sum()), abs=1e-11)
        refs.setdefault(text, []).append(out.logprob)
    # Each adapter changes the result: the same text under each (and the base model).
    same = eng.score([TEXTS[0]] * 3, adapters=[None, "a", "b"])
    assert len({o.logprob for o in same}) == 3
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_embed_under_adapters_equals_peft_hidden_states(embedders, family):
    from transformers import AutoModel

    base, folders = embedders[family]
    paths = {k: str(v) for k, v in folders.items()}
    eng = Engine.from_pretrained(
        str(base), task="embed", device="cpu", dtype="float64", max_num_batched_tokens=16, lora=paths
    )
    outs = eng.embed(TEXTS, adapters=NAMES)
    for text, name, out in zip(TEXTS, NAMES, outs, strict=True):
        ids = eng.tokenize(text)
        model = _peft(lambda: AutoModel.from_pretrained(str(base)), folders.get(name or ""))
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        pooled = hidden.mean(0) if family == "bert" else hidden[-1]  # the folders' mean / lasttoken
        ref = torch.nn.functional.normalize(pooled, dim=0).numpy()
        assert out.error is None
        assert np.abs(out.embedding - ref).max() <= 1e-12, name
    same = eng.embed([TEXTS[1]] * 3, adapters=[None, "a", "b"])
    assert len({o.embedding.tobytes() for o in same}) == 3


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen2"])
def test_classify_with_each_adapters_head_equals_peft(classifiers, family):
    from transformers import AutoModelForSequenceClassification

    base, folders = classifiers[family]
    paths = {k: str(v) for k, v in folders.items()}
    eng = Engine.from_pretrained(
        str(base), task="classify", device="cpu", dtype="float64", max_num_batched_tokens=16, lora=paths
    )
    assert set(eng.tasks.heads) == {1, 2}  # both saved their fine-tuned head (modules_to_save)
    outs = eng.classify(TEXTS, adapters=NAMES)
    for text, name, out in zip(TEXTS, NAMES, outs, strict=True):
        model = _peft(
            lambda: AutoModelForSequenceClassification.from_pretrained(str(base)), folders.get(name or "")
        )
        with torch.no_grad():
            ref = model(torch.tensor([eng.tokenize(text)])).logits[0].numpy()
        assert out.error is None
        assert np.abs(out.logits - ref).max() <= 1e-12, name
    same = eng.classify([TEXTS[2]] * 3, adapters=[None, "a", "b"])
    assert len({o.logits.tobytes() for o in same}) == 3


def _values(out) -> tuple:
    return tuple(
        None if v is None else np.asarray(v).tobytes()
        for v in (out.embedding, out.logits, out.logprob, out.token_logprobs, out.error)
    )


@pytest.mark.parametrize("task", ["score", "embed", "classify"])
def test_a_rows_floats_do_not_depend_on_the_steps_adapters(scorer, embedders, classifiers, task):
    """float32, bit for bit: each row alone in a fresh engine and all rows (two adapters and base rows)
    packed together in chunks, with the prefix cache serving the repeated texts, write the same floats."""
    base, folders = {"score": scorer, "embed": embedders["qwen3"], "classify": classifiers["qwen2"]}[task]
    paths = {k: str(v) for k, v in folders.items()}
    texts = TEXTS + TEXTS[:3]
    names = NAMES + ["b", None, "a"]

    def run(indices, **kw):
        kw = {"block_size": 4, "max_num_batched_tokens": 13, **kw}
        eng = Engine.from_pretrained(str(base), task=task, device="cpu", dtype="float32", lora=paths, **kw)
        kwargs = {"token_logprobs": True} if task == "score" else {}
        outs = getattr(eng, task)([texts[i] for i in indices], adapters=[names[i] for i in indices], **kwargs)
        return [_values(o) for o in outs]

    together = run(range(len(texts)), max_num_seqs=4)
    for i in range(len(texts)):
        assert run([i]) == [together[i]], f"row {i} ({names[i]}) differs alone"


def test_refused_by_name(scorer, classifiers, tmp_path):
    from transformers import AutoModelForSequenceClassification

    base, folders = scorer
    # A classifier adapter's head on a score engine: modules_to_save only with classify.
    clf, clf_folders = classifiers["qwen2"]
    with pytest.raises(ConfigError, match="modules_to_save is not supported here"):
        Engine.from_pretrained(str(base), task="score", device="cpu", lora={"a": str(clf_folders["a"])})
    # (a classifier's checkpoint has no LM head to score with: refused before any adapter is read)
    with pytest.raises(ModelNotFoundError, match="its checkpoint has no lm_head.weight"):
        Engine.from_pretrained(str(clf), task="score", device="cpu", lora={"a": str(clf_folders["a"])})
    # A saved module other than the task head.
    load = lambda: AutoModelForSequenceClassification.from_pretrained(str(clf))  # noqa: E731
    norm = _peft_folder(
        load(),
        tmp_path / "norm",
        3,
        r=2,
        target_modules=["q_proj"],
        task_type="SEQ_CLS",
        modules_to_save=["score", "norm"],
    )
    with pytest.raises(
        ConfigError, match=r"is a saved module \(model\.\S*norm\) that is not the task head \(score\)"
    ):
        Engine.from_pretrained(str(clf), task="classify", device="cpu", lora={"n": str(norm)})
    # LoRA on the head itself (read after the body: not a step's packed rows).
    head = _peft_folder(load(), tmp_path / "head", 4, r=2, target_modules=["q_proj", "score"])
    with pytest.raises(ConfigError, match="targets 'score'.*not supported with task='classify'"):
        Engine.from_pretrained(str(clf), task="classify", device="cpu", lora={"h": str(head)})
    with pytest.raises(ConfigError, match="compile"):
        Engine.from_pretrained(
            str(base), task="score", device="cpu", compile=True, lora={"a": str(folders["a"])}
        )
    eng = Engine.from_pretrained(str(base), task="score", device="cpu", lora={"a": str(folders["a"])})
    with pytest.raises(ConfigError, match="unknown LoRA adapter 'nope'"):
        eng.score(["hello there"], adapters=["nope"])
