"""A classifier's head read as its config's ``problem_type`` says, against transformers' own
``pipeline("text-classification", top_k=None)``: a multi-label head gives a sigmoid per label and the labels
above 0.5 (never a softmax and one argmax label), a regression head its raw values, an unknown problem type
is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.errors import BatchjobError
from tests.task_models import make_classifier
from tests.tiers import engine_fixture

pytestmark = pytest.mark.timeout(600)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "0 1 2",
    "This product is great, I love it! Terrible quality, it broke after a day.",
    "!",
]


@engine_fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    multi = dict(problem_type="multi_label_classification")
    return {
        "bert": make_classifier(root / "bert", "bert", 4, **multi),
        "qwen2": make_classifier(root / "qwen2", "qwen2", 3, **multi),
        "regression": make_classifier(root / "reg", "bert", 2, problem_type="regression"),
    }


def _pipeline(folder):
    from transformers import pipeline

    return pipeline("text-classification", model=str(folder), top_k=None, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("family", ["bert", "qwen2"])
def test_multi_label_head_is_a_sigmoid_per_label(heads, family):
    folder = heads[family]
    eng = Engine.from_pretrained(str(folder), task="classify", device="cpu", dtype="float64")
    outs = eng.classify(TEXTS)
    refs = _pipeline(folder)(TEXTS)
    chosen = set()
    for out, ref in zip(outs, refs, strict=True):
        assert out.error is None and out.label is None
        want = {r["label"]: r["score"] for r in ref}
        probs = {f"L{i}": float(p) for i, p in enumerate(out.probs)}
        assert probs.keys() == want.keys()
        assert max(abs(probs[k] - want[k]) for k in want) <= 1e-6  # the pipeline reads float32
        assert np.allclose(out.probs, 1 / (1 + np.exp(-out.logits)), atol=1e-15)
        assert out.labels == [k for k in probs if want[k] > 0.5]  # in label order
        chosen.add(len(out.labels))
    assert len(chosen) > 1 or chosen != {1}, "the tiny head should not pick exactly one label every time"


def test_regression_head_gives_its_values(heads):
    eng = Engine.from_pretrained(str(heads["regression"]), task="classify", device="cpu", dtype="float64")
    for out, ref in zip(eng.classify(TEXTS), _pipeline(heads["regression"])(TEXTS), strict=True):
        assert out.probs is None and out.label is None and out.labels is None
        assert sorted(out.logits.tolist()) == pytest.approx(sorted(r["score"] for r in ref), abs=1e-6)


@pytest.mark.engine
def test_unknown_problem_type_is_refused(tmp_path):
    import json

    folder = make_classifier(tmp_path / "odd", "bert", 2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"problem_type": "ordinal"}))
    with pytest.raises(BatchjobError, match="problem_type") as refused:
        Engine.from_pretrained(str(folder), task="classify", device="cpu")
    print(refused.value)


@pytest.mark.engine
def test_a_cross_encoder_folder_is_refused_naming_its_activation(tmp_path):
    """A sentence-transformers CrossEncoder scores a (query, document) pair, the second text in a segment of
    its own, through its activation (a sigmoid): classify read one text and wrote the raw logit (0.082 where
    predict gives 0.521). Refused, as sentence-transformers 6 saves it and as 5 did (in config.json)."""
    import json

    from sentence_transformers import CrossEncoder

    folder = make_classifier(tmp_path / "ce", "bert", 1)
    CrossEncoder(str(folder), device="cpu").save(str(tmp_path / "saved"))
    with pytest.raises(BatchjobError, match="model_type 'CrossEncoder'.* pair .*activation.Sigmoid"):
        Engine.from_pretrained(str(tmp_path / "saved"), task="classify", device="cpu")
    config = json.loads((folder / "config.json").read_text())
    legacy = {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.0.1"}
    (folder / "config.json").write_text(json.dumps(config | {"sentence_transformers": legacy}))
    with pytest.raises(BatchjobError, match="sentence_transformers.activation_fn: .*linear.Identity"):
        Engine.from_pretrained(str(folder), task="classify", device="cpu")
    older = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}  # before 4.0
    (folder / "config.json").write_text(json.dumps(config | older))
    with pytest.raises(BatchjobError, match="sbert_ce_default_activation_function: .*activation.Sigmoid"):
        Engine.from_pretrained(str(folder), task="classify", device="cpu")
