"""Jobs of the prefill-only tasks (``--task embed|classify|score``): the options each task takes, the result
columns and their Arrow types, Parquet values equal to ``Engine.embed/classify/score`` (which test_tasks.py
proves against sentence-transformers and HF), error rows, the job's identity, and exact resume after SIGKILL.
"""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.engine.engine import Engine
from batchjob.errors import ConfigError
from batchjob.io.atomic import read_json, write_json
from batchjob.job import make_spec, run_job
from tests.task_models import make_classifier, make_embedder
from tests.tiers import engine_fixture

pytestmark = pytest.mark.timeout(600)

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "light", "music"]


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def write_rows(path, n=12, long_at=(5,), empty_at=(7,)):
    """``n`` JSONL rows (ids ``r00``..): a ``text``, a ``topic`` and an ``answer``; the rows in ``long_at``
    have a text of 300 words, those in ``empty_at`` an empty one; a torn last line."""
    with open(path, "w") as f:
        for i in range(n):
            words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 5)]
            text = " ".join(words * 60) if i in long_at else "" if i in empty_at else " ".join(words)
            row = {
                "rid": f"r{i:02d}",
                "text": text,
                "topic": WORDS[i % 10],
                "answer": f" {WORDS[(i + 3) % 10]}",
            }
            f.write(json.dumps(row) + "\n")
        f.write("{torn json\n")
    return path


def rows_of(out) -> list[dict]:
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["rid"] is None, r["rid"] or "", r["error"] or ""))


def job(tmp_path, model, task, name="out", **kw):
    data = tmp_path / "rows.jsonl"
    if not data.exists():
        write_rows(data)
    spec = make_spec(
        input=[str(data)], output=str(tmp_path / name), model=str(model), task=task, id_column="rid", **kw
    )
    result = run_job(spec)
    assert result.status == "complete"
    return tmp_path / name, rows_of(tmp_path / name)


# -- options: what each task takes, refused before any work ------------------------------------------------


@pytest.mark.parametrize(
    "task, given, named",
    [
        ("embed", {"choices": "a,b"}, "--choices"),
        ("classify", {"temperature": 0.7}, "--temperature"),
        ("score", {"max_new_tokens": 5}, "--max-new-tokens"),
        ("score", {"n": 2}, "--n"),
        ("embed", {"logprobs": 0}, "--logprobs"),
        ("classify", {"pooling": "cls"}, "--pooling"),
        ("score", {"dimensions": 8}, "--dimensions"),
        ("embed", {"score_column": "answer"}, "--score-column"),
        ("generate", {"pooling": "mean"}, "--pooling"),
        ("generate", {"truncate": True}, "--truncate"),
        ("generate", {"score_column": "answer"}, "--score-column"),
        ("classify", {"prompt_name": "query"}, "--prompt-name"),
        ("generate", {"prompt_name": "query"}, "--prompt-name"),
    ],
)
def test_an_option_the_task_has_no_use_for_is_refused_by_name(task, given, named):
    with pytest.raises(ConfigError, match=named):
        make_spec(input=["x.jsonl"], output="out", task=task, **given)


def test_score_refuses_a_system_text_it_would_score():
    """--system before an unconditional score's text was scored with it (num_scored_tokens 6 became 45):
    refused, naming --score-column, with which the system text stays in the unscored prompt."""
    with pytest.raises(ConfigError, match="--system with --task score and no --score-column"):
        make_spec(input=["x.jsonl"], output="out", task="score", system="Be brief.")
    make_spec(input=["x.jsonl"], output="out", task="score", system="Be brief.", score_column="answer")
    make_spec(input=["x.jsonl"], output="out", task="classify", system="Be brief.")


def test_score_logprobs_takes_no_k_and_the_cli_refuses_before_work(tmp_path):
    with pytest.raises(ConfigError, match="--logprobs takes no K"):
        make_spec(input=["x.jsonl"], output="out", task="score", logprobs=3)
    data = write_rows(tmp_path / "rows.jsonl")
    code, text = invoke("run", "--task", "embed", "--input", data, "--output", tmp_path / "o", "--stop", "x")
    assert code == 2 and "--stop has no meaning for --task embed" in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()
    code, text = invoke("run", "--task", "bogus", "--input", data, "--output", tmp_path / "o")
    assert code == 2 and "bogus" in text
    code, text = invoke(
        "validate", "--task", "score", "--score-column", "nope", "--input", data, "--output", tmp_path / "o"
    )
    assert code == 2 and "--score-column 'nope'" in text and "Traceback" not in text


def test_job_file_takes_task_keys(tmp_path):
    (tmp_path / "job.toml").write_text(
        'input = "in.jsonl"\noutput = "out"\ntask = "embed"\npooling = "cls"\nnormalize = true\ndimensions = 16\n'
    )
    spec = make_spec(tmp_path / "job.toml")
    engine = spec.engine
    assert (engine.task, engine.pooling, engine.normalize, engine.dimensions) == ("embed", "cls", True, 16)
    options = engine.as_keywords()
    assert options["task"] == "embed" and options["pooling"] == "cls" and options["dimensions"] == 16


# -- results equal the engine's ----------------------------------------------------------------------------


def _texts(tmp_path):
    return {
        json.loads(line)["rid"]: json.loads(line)
        for line in (tmp_path / "rows.jsonl").read_text().splitlines()
        if line.startswith('{"')
    }


def test_embed_job_writes_what_engine_embed_computes(tiny_model_dir, tmp_path):
    out, rows = job(tmp_path, tiny_model_dir, "embed", max_model_len=64, dimensions=24, normalize=True)
    schema = ds.dataset(out, format="parquet").schema
    assert schema.field("embedding").type == pa.list_(pa.float32(), 24)
    assert schema.names[-3:] == ["embedding", "num_prompt_tokens", "error"]
    assert "generated_text" not in schema.names and "finish_reason" not in schema.names
    texts = _texts(tmp_path)
    engine = Engine.from_pretrained(
        str(tiny_model_dir), task="embed", max_model_len=64, dimensions=24, normalize=True
    )
    ok = [r for r in rows if r["error"] is None]
    expected = engine.embed([texts[r["rid"]]["text"] for r in ok])
    for r, e in zip(ok, expected, strict=True):
        assert np.array_equal(np.asarray(r["embedding"], dtype=np.float32), e.embedding.astype(np.float32))
        assert r["num_prompt_tokens"] == len(e.prompt_ids)
    by_id = {r["rid"]: r for r in rows}
    assert "longer" in by_id["r05"]["error"] or "tokens" in by_id["r05"]["error"]  # too long, no --truncate
    assert by_id["r05"]["embedding"] is None
    assert by_id["r07"]["error"] == "rows.jsonl line 8: column 'text' is empty"  # whose row it is
    assert by_id["r05"]["error"].startswith("rows.jsonl line 6: ")
    assert any(r["rid"] is None and "line 13" in r["error"] for r in rows)  # the torn line
    assert len(ok) == 10


def test_embed_truncate_cuts_as_the_engine_does(tiny_model_dir, tmp_path):
    _, rows = job(
        tmp_path, tiny_model_dir, "embed", max_model_len=64, truncate=True, template="{topic}: {text}"
    )
    texts = _texts(tmp_path)
    engine = Engine.from_pretrained(str(tiny_model_dir), task="embed", max_model_len=64, truncate=True)
    long = next(r for r in rows if r["rid"] == "r05")
    assert long["error"] is None and long["num_prompt_tokens"] == 64
    (expected,) = engine.embed([f"{texts['r05']['topic']}: {texts['r05']['text']}"])
    assert np.array_equal(np.asarray(long["embedding"], dtype=np.float32), expected.embedding)


@engine_fixture(scope="module")
def task_model_dirs(tmp_path_factory):
    """Tiny models with the files real ones have: an embedder whose sentence-transformers files say CLS
    pooling and Normalize, and BERT classifiers with three labels and with one output."""
    root = tmp_path_factory.mktemp("task_models")
    return {
        "embedder": make_embedder(root / "st", "bert", "cls"),
        3: make_classifier(root / "clf3", "bert", 3),
        1: make_classifier(root / "clf1", "bert", 1),
        "multi": make_classifier(root / "multi", "bert", 4, problem_type="multi_label_classification"),
        "chat": make_embedder(
            root / "chat",
            "qwen3",
            "lasttoken",
            chat=True,
            prompts={"doc": "Doc: "},
            default_prompt_name="doc",
        ),
    }


def test_embed_pooling_from_sentence_transformers_files(task_model_dirs, tmp_path):
    model = task_model_dirs["embedder"]
    _, rows = job(tmp_path, model, "embed")
    ok = [r for r in rows if r["error"] is None]
    expected = Engine.from_pretrained(str(model), task="embed").embed(
        [_texts(tmp_path)[r["rid"]]["text"] for r in ok]
    )
    for r, e in zip(ok, expected, strict=True):
        assert np.array_equal(np.asarray(r["embedding"], dtype=np.float32), e.embedding)
        assert abs(np.linalg.norm(r["embedding"]) - 1.0) < 1e-5  # the folder's Normalize module


def test_score_job_conditional_with_token_logprobs_equals_engine_score(tiny_model_dir, tmp_path):
    out, rows = job(
        tmp_path, tiny_model_dir, "score", template="Topic {topic}:", score_column="answer", logprobs=0
    )
    schema = ds.dataset(out, format="parquet").schema
    assert [(f.name, f.type) for f in schema][-6:] == [
        ("logprob", pa.float64()),
        ("num_scored_tokens", pa.int64()),
        ("perplexity", pa.float64()),
        ("token_logprobs", pa.list_(pa.float64())),
        ("num_prompt_tokens", pa.int64()),
        ("error", pa.string()),
    ]
    texts = _texts(tmp_path)
    ok = [r for r in rows if r["error"] is None]
    assert len(ok) == 12  # the text column is not used: every row has a topic and an answer
    engine = Engine.from_pretrained(str(tiny_model_dir), task="score")
    expected = engine.score(
        [f"Topic {texts[r['rid']]['topic']}:" for r in ok],
        [texts[r["rid"]]["answer"] for r in ok],
        token_logprobs=True,
    )
    for r, e in zip(ok, expected, strict=True):
        assert r["logprob"] == e.logprob and r["num_scored_tokens"] == e.num_scored_tokens
        assert r["token_logprobs"] == e.token_logprobs and r["perplexity"] == e.perplexity


def test_a_scored_text_cut_by_truncate_counts_the_tokens_read(tiny_model_dir, tmp_path):
    """--truncate cuts a long scored text at the limit: num_prompt_tokens is what was read (64), not the
    prompt and the whole text (an unconditional row said so already)."""
    _, rows = job(
        tmp_path,
        tiny_model_dir,
        "score",
        template="Topic {topic}:",
        score_column="text",
        max_model_len=64,
        truncate=True,
    )
    long = next(r for r in rows if r["rid"] == "r05")
    assert long["error"] is None and long["num_prompt_tokens"] == 64 and long["num_scored_tokens"] < 64
    short = next(r for r in rows if r["rid"] == "r00")
    assert short["num_prompt_tokens"] < 64


def test_a_scored_text_is_cut_from_its_end_whatever_the_tokenizers_side(tiny_model_dir, tmp_path):
    """--score-column --truncate on a tokenizer with truncation_side "left": the job scores the text's first
    tokens after the prompt, as on a tokenizer that cuts on the right (it scored a piece from the text's
    middle: -165.005 where the first 27 tokens give -165.690, with the same num_scored_tokens)."""
    import shutil

    left = tmp_path / "left"
    shutil.copytree(tiny_model_dir, left)
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    prompt, text = "The capital of France is", " " + " ".join(str(i) for i in range(40))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"rid": "a", "q": prompt, "a": text}) + "\n")
    kw = dict(prompt_column="q", score_column="a", truncate=True, max_model_len=32, dtype="float64")
    _, [row] = job(tmp_path, left, "score", **kw)
    right = Engine.from_pretrained(
        str(tiny_model_dir), task="score", truncate=True, max_model_len=32, dtype="float64"
    )
    [want] = right.score([prompt], [text])
    assert row["error"] is None and row["num_prompt_tokens"] == 32
    assert (row["logprob"], row["num_scored_tokens"]) == (want.logprob, want.num_scored_tokens)


def test_score_job_unconditional_equals_engine_score(tiny_model_dir, tmp_path):
    _, rows = job(tmp_path, tiny_model_dir, "score", max_model_len=64)
    texts = _texts(tmp_path)
    ok = [r for r in rows if r["error"] is None]
    expected = Engine.from_pretrained(str(tiny_model_dir), task="score", max_model_len=64).score(
        [texts[r["rid"]]["text"] for r in ok]
    )
    for r, e in zip(ok, expected, strict=True):
        assert r["logprob"] == e.logprob and r["num_scored_tokens"] == e.num_scored_tokens
    assert "token_logprobs" not in rows[0]
    errors = {r["rid"]: r["error"] for r in rows if r["error"] is not None}
    assert set(errors) == {"r05", "r07", None}


def test_a_classify_input_with_a_text_pair_column_its_prompts_leave_out_is_refused(task_model_dirs, tmp_path):
    """A text_pair column (a pair classifier's second text, as transformers' pipeline takes it) was left out
    without a word: two rows with one text and different pairs got one score. Refused before any work,
    naming it, unless the prompt reads it (a --template naming it)."""
    pairs = ("A cat was sitting.", "Stocks fell.")
    rows = [{"rid": f"r{i}", "text": "The cat sat.", "text_pair": p} for i, p in enumerate(pairs)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = task_model_dirs[3]
    with pytest.raises(
        ConfigError, match="the input has a 'text_pair' column, a pair classifier's second text"
    ):
        job(tmp_path, model, "classify")
    assert not (tmp_path / "out").exists()
    _, got = job(tmp_path, model, "classify", template="{text} {text_pair}")
    assert got[0]["error"] is None and got[0]["scores"] != got[1]["scores"]


@pytest.mark.parametrize("num_labels", [3, 1])
def test_classify_job_equals_engine_classify(task_model_dirs, tmp_path, num_labels):
    model = task_model_dirs[num_labels]
    out, rows = job(tmp_path, model, "classify", truncate=True)
    names = ds.dataset(out, format="parquet").schema.names
    if num_labels > 1:
        assert names[-5:] == ["scores", "probs", "label", "num_prompt_tokens", "error"]
    else:
        assert names[-4:] == ["scores", "score", "num_prompt_tokens", "error"]
    ok = [r for r in rows if r["error"] is None]
    expected = Engine.from_pretrained(str(model), task="classify", truncate=True).classify(
        [_texts(tmp_path)[r["rid"]]["text"] for r in ok]
    )
    assert len(ok) == 11  # the long row is cut (--truncate), the empty one is an error
    for r, e in zip(ok, expected, strict=True):
        assert np.array_equal(np.asarray(r["scores"], dtype=np.float32), e.logits.astype(np.float32))
        if num_labels > 1:
            assert r["label"] == e.label and np.array_equal(np.asarray(r["probs"], dtype=np.float32), e.probs)
        else:
            assert r["score"] == np.float32(e.score)
    if num_labels > 1:  # report: the labels counted, the generation-only figures left out
        page = tmp_path / "report.html"
        code, text = invoke("report", out, "--to", page)
        assert code == 0, text
        html = page.read_text()
        assert "labels" in html and "finish reasons" not in html and "output lengths" not in html


@pytest.mark.parametrize("task", ["classify", "embed", "score"])
def test_a_conversation_is_read_as_it_is_without_a_generation_prompt(tiny_model_dir, tmp_path, task):
    """--messages-column with a task that reads the text (a reward model's score, an embedding, a whole text's
    log-likelihood) renders the conversation as transformers' apply_chat_template(conv) does: no assistant
    header after it, which a reward model would read as the end of the text (its score was -2.06 where
    transformers gives -2.30)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = make_classifier(tmp_path / "rm", "qwen2", 1, chat=True) if task == "classify" else tiny_model_dir
    conv = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"rid": "a", "messages": conv}) + "\n")
    out, (row,) = job(tmp_path, model, task, messages_column="messages")
    tok = AutoTokenizer.from_pretrained(str(model))
    ids = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    assert row["error"] is None and row["num_prompt_tokens"] == len(ids)
    if task == "classify":
        rm = AutoModelForSequenceClassification.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.no_grad():
            want = rm(torch.tensor([ids])).logits[0, 0].item()
        assert abs(row["score"] - want) < 1e-4, (row["score"], want)
    # a job saved when every render ended with the generation prompt is refused on resume, by name
    saved = read_json(out / "_batchjob" / "job.json")
    del saved["fingerprint"]["prompt"]["generation_prompt"]
    write_json(out / "_batchjob" / "job.json", saved)
    data = tmp_path / "rows.jsonl"
    base = ["run", "--input", data, "--output", out, "--model", model, "--id-column", "rid", "--task", task]
    code, text = invoke(*base, "--messages-column", "messages")
    assert code == 2 and "prompt.generation_prompt: was None, now False" in text, text


def test_multi_label_classify_job_writes_labels(task_model_dirs, tmp_path):
    model = task_model_dirs["multi"]
    out, rows = job(tmp_path, model, "classify", truncate=True)
    schema = ds.dataset(out, format="parquet").schema
    assert [(f.name, f.type) for f in schema][-5:] == [
        ("scores", pa.list_(pa.float32())),
        ("probs", pa.list_(pa.float32())),
        ("labels", pa.list_(pa.string())),
        ("num_prompt_tokens", pa.int64()),
        ("error", pa.string()),
    ]
    ok = [r for r in rows if r["error"] is None]
    expected = Engine.from_pretrained(str(model), task="classify", truncate=True).classify(
        [_texts(tmp_path)[r["rid"]]["text"] for r in ok]
    )
    for r, e in zip(ok, expected, strict=True):
        assert r["labels"] == e.labels and np.array_equal(np.asarray(r["probs"], dtype=np.float32), e.probs)
    assert "label" not in rows[0]
    # the head's reading is in the job's identity (a single-label job's identity is as it was)
    from batchjob.job.tasks import head_fingerprint

    spec = make_spec(input=["x.jsonl"], output="o", model=str(model), task="classify")
    assert head_fingerprint(spec) == {"head": "multi"}
    assert (
        head_fingerprint(
            make_spec(input=["x.jsonl"], output="o", model=str(task_model_dirs[3]), task="classify")
        )
        == {}
    )


def test_embed_job_makes_each_input_as_the_folder_says(task_model_dirs, tmp_path):
    """A folder whose sentence-transformers files render each text through the chat template after a
    default prompt: the job writes what Engine.embed (equal to encode) computes, with each --prompt-name;
    --chat would render it twice and is refused, by name, before work."""
    model = task_model_dirs["chat"]
    for name, prompt_name in (("default", None), ("none", "")):
        _, rows = job(tmp_path, model, "embed", name=name, prompt_name=prompt_name)
        texts = _texts(tmp_path)
        ok = [r for r in rows if r["error"] is None]
        engine = Engine.from_pretrained(str(model), task="embed")
        expected = engine.embed([texts[r["rid"]]["text"] for r in ok], prompt_name=prompt_name)
        assert len(ok) == 10  # the long row and the empty one are errors
        for r, e in zip(ok, expected, strict=True):
            assert np.array_equal(np.asarray(r["embedding"], dtype=np.float32), e.embedding)
    data = tmp_path / "rows.jsonl"
    args = ("run", "--task", "embed", "--model", model, "--input", data, "--id-column", "rid")
    code, text = invoke(*args, "--output", tmp_path / "o", "--chat")
    assert code == 2 and "--chat: the model folder's sentence-transformers files" in text, text
    for command in ("run", "validate"):
        code, text = invoke(command, *args[1:], "--output", tmp_path / "o2", "--prompt-name", "passage")
        assert code == 2 and "prompt name 'passage' is not one of the model's prompts" in text, text


# -- identity, status, report, export ----------------------------------------------------------------------


def test_resume_with_another_task_or_embed_option_is_refused_naming_it(tiny_model_dir, tmp_path):
    out, _ = job(tmp_path, tiny_model_dir, "embed", pooling="mean")
    data = tmp_path / "rows.jsonl"
    base = ["run", "--input", data, "--output", out, "--model", tiny_model_dir, "--id-column", "rid"]
    code, text = invoke(*base, "--task", "embed", "--pooling", "last")
    assert code == 2 and "task.pooling: was 'mean', now 'last'" in text
    code, text = invoke(*base, "--task", "embed", "--pooling", "mean", "--dimensions", "8")
    assert code == 2 and "task.dimensions: was None, now 8" in text
    code, text = invoke(*base, "--task", "score")
    assert code == 2 and "task.task: was 'embed', now 'score'" in text
    # Chunks of another size could change the floats' last bits; a larger budget leaves them as they were.
    code, text = invoke(*base, "--task", "embed", "--pooling", "mean", "--max-num-batched-tokens", "64")
    assert code == 2 and "task.chunks.tokens: was None, now 64" in text, text
    code, text = invoke(*base, "--task", "embed", "--pooling", "mean", "--max-num-batched-tokens", "2048")
    assert code == 0 and "already complete" in text, text
    # ...and so could another backend (up to 3e-8 apart, written beside the first run's floats)
    code, text = invoke(*base, "--task", "embed", "--pooling", "mean", "--attention-backend", "flex")
    assert code == 2 and "task.kernels.attention_backend: was None, now 'flex'" in text, text
    # a job recorded before the kernels were is not told apart by them (nor asked for them again)
    saved = read_json(out / "_batchjob" / "job.json")
    del saved["fingerprint"]["task"]["kernels"]
    write_json(out / "_batchjob" / "job.json", saved)
    for backend in ("flex", "auto"):
        code, text = invoke(*base, "--task", "embed", "--pooling", "mean", "--attention-backend", backend)
        assert code == 0 and "already complete" in text, text
    code, text = invoke(*base, "--task", "embed", "--pooling", "mean")
    assert code == 0 and "already complete" in text
    code, text = invoke("status", out)
    assert code == 0 and f"{out}: complete" in text and "read (--task embed)" in text, text
    code, text = invoke("report", out)
    assert code == 0, text
    # the report's summary as status's: tokens read and their rate (it said "generated tokens/s: 0.0")
    summary = (out / "_batchjob" / "report.html").read_text().split("</p>")[0]
    assert re.search(r"tokens: \d+ read \(--task embed\)", summary), summary
    assert re.search(r"[\d.]+ rows/s, [\d.]+ tok/s read", summary) and "generated" not in summary, summary
    for fmt in ("jsonl", "csv"):
        target = tmp_path / f"export.{fmt}"
        code, text = invoke("export", out, "--format", fmt, "--to", target)
        assert code == 0, text
        assert target.read_text().count("\n") >= 12


def write_shared_prompt_rows(path, n=60):
    """``n`` JSONL rows of ten prompts, each asked with several answers (so the prefix cache serves the
    later ones), some long enough to be scored in several chunks; row 3 has an empty text."""
    with open(path, "w") as f:
        for i in range(n):
            p = i % 10
            words = [WORDS[(p * 7 + k * 3) % len(WORDS)] for k in range(3 + p % 5)]
            answer = " " + " ".join(WORDS[(i + j) % 10] for j in range(1 + i % 3))
            text = "" if i == 3 else " ".join(words * (1 + p % 4))
            f.write(
                json.dumps({"rid": f"r{i:02d}", "text": text, "topic": WORDS[p], "answer": answer}) + "\n"
            )
    return path


@pytest.mark.engine
def test_a_task_job_an_earlier_batchjob_computed_otherwise_is_not_resumed(tiny_model_dir, tmp_path):
    """A folder's truncate_dim (read since 2026-12-07) and a bf16 score's log-softmax (float32 since then)
    changed what such a job writes: one an earlier batchjob started, resumed or appended, mixed vectors of
    64 and 16 dimensions (and bf16 log-probabilities beside float32 ones) in one output. It is refused."""
    folder = make_embedder(tmp_path / "m", "bert", "mean", truncate_dim=16)
    cases = [
        ("embed", folder, [], "task.folder.truncate_dim: was None, now 16"),
        ("score", tiny_model_dir, ["--dtype", "bfloat16"], "task.logsoftmax: was None, now 'float32'"),
    ]
    for task, model, extra, message in cases:
        out, rows = job(tmp_path, model, task, name=f"out_{task}", dtype=(extra or [None, None])[1])
        assert sum(r["error"] is None for r in rows) > 1
        saved = read_json(out / "_batchjob" / "job.json")
        saved["fingerprint"]["task"].pop(message.split(":")[0].split(".")[1])  # as an earlier one recorded it
        write_json(out / "_batchjob" / "job.json", saved)
        base = ["run", "--input", tmp_path / "rows.jsonl", "--output", out, "--model", model, "--task", task]
        code, text = invoke(*base, "--id-column", "rid", *extra)
        assert code == 2 and message in text, text


def test_killed_and_resumed_task_job_writes_what_an_uninterrupted_one_does(launch, tiny_model_dir, tmp_path):
    """Bit for bit, with the prefix cache on and rows scored in chunks: which rows share a step, and which
    prompts a restart finds cached, differ between the two runs (see the scheduler's chunk grid)."""
    from tests.faultproc import wait_for_points, wait_gone

    data = write_shared_prompt_rows(tmp_path / "rows.jsonl")
    ref = tmp_path / "ref"
    args = ["--input", data, "--model", tiny_model_dir, "--task", "score", "--score-column", "answer"]
    args += ["--template", "About {topic}: {text}", "--id-column", "rid", "--logprobs", "--block-size", "4"]
    args += ["--max-num-seqs", "3", "--max-num-batched-tokens", "24", "--checkpoint-interval", "0.001"]
    code, text = invoke("run", *args, "--output", ref)  # uninterrupted, in this process
    assert code == 0, text
    out = tmp_path / "out"
    proc = launch([str(a) for a in [*args, "--output", out]], BATCHJOB_FAULT_PAUSE="part_committed")
    [pid], _ = wait_for_points(proc)  # a part committed, rows in the engine
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not wait_gone([pid])
    partial = rows_of(out)
    assert 0 < len(partial) < 60
    code, output = invoke("run", *args, "--output", out)  # the resume, in this process (a fresh engine)
    assert code == 0, output
    got, expected = rows_of(out), rows_of(ref)
    assert [r["rid"] for r in got] == [r["rid"] for r in expected]  # every row exactly once
    assert got == expected


def test_devices_split_an_embed_job_into_shards_that_add_up(launch, tiny_model_dir, tmp_path):

    data = write_rows(tmp_path / "rows.jsonl", n=30)
    args = ["--input", data, "--model", tiny_model_dir, "--task", "embed", "--id-column", "rid"]
    args += ["--max-model-len", "64", "--no-prefix-caching", "--max-num-seqs", "2"]
    code, text = invoke("run", *args, "--output", tmp_path / "ref")
    assert code == 0, text
    out = tmp_path / "out"
    proc = launch([str(a) for a in ["--devices", "cpu,cpu", *args, "--output", out]])
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text
    assert "worker shard 0 of 2 on cpu: exit 0" in text and "worker shard 1 of 2 on cpu: exit 0" in text
    assert rows_of(out) == rows_of(tmp_path / "ref")
    code, text = invoke("status", out)
    assert code == 0 and "complete (2 of 2 workers complete)" in text
    # each worker's rate and the sum: rows and tokens read (they said "0.0 generated tok/s")
    assert re.search(r"^throughput: [\d.]+ rows/s, [\d.]+ tok/s read \(workers' last runs", text, re.M), text
    shards = re.findall(r"^  shard \d of 2: complete, .*, [\d.]+ rows/s, [\d.]+ tok/s read$", text, re.M)
    assert len(shards) == 2, text
    assert "generated" not in text, text


def test_openai_embeddings_requests_in_and_embedding_objects_out(tiny_model_dir, tmp_path):
    data = tmp_path / "requests.jsonl"
    lines = [
        {"custom_id": "one", "body": {"input": "The cat sat.", "model": "m", "encoding_format": "float"}},
        {
            "custom_id": "many",
            "body": {"input": ["One.", "Two words.", "Three more words."], "dimensions": 16},
        },
        {"custom_id": "dims", "body": {"input": "x", "dimensions": 8}},
        {"custom_id": "b64", "body": {"input": "x", "encoding_format": "base64"}},
        {"custom_id": "empty", "body": {"input": []}},
    ]
    with open(data, "w") as f:
        for line in lines:
            f.write(json.dumps({"method": "POST", "url": "/v1/embeddings"} | line) + "\n")
        f.write(
            json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}})
        )
        f.write("\n")
    out = tmp_path / "out"
    args = ["--task", "embed", "--format", "openai", "--dimensions", "16", "--model", tiny_model_dir]
    code, text = invoke("run", *args, "--input", data, "--output", out)
    assert code == 0 and "complete: 6 of 6 rows done (4 errors)" in text, text
    assert ds.dataset(out, format="parquet").schema.field("sample_index").type == pa.int64()
    code, text = invoke("export", out, "--format", "openai", "--to", tmp_path / "out.jsonl")
    assert code == 0, text
    got = {d["custom_id"]: d for d in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    engine = Engine.from_pretrained(str(tiny_model_dir), task="embed", dimensions=16)
    for custom_id, texts in (
        ("one", ["The cat sat."]),
        ("many", ["One.", "Two words.", "Three more words."]),
    ):
        body = got[custom_id]["response"]["body"]
        assert got[custom_id]["response"]["status_code"] == 200 and got[custom_id]["error"] is None
        assert (
            body["object"] == "list"
            and body["model"]
            and set(body["usage"]) == {"prompt_tokens", "total_tokens"}
        )
        expected = engine.embed(texts)
        assert [d["index"] for d in body["data"]] == list(range(len(texts)))
        for d, e in zip(body["data"], expected, strict=True):
            assert d["object"] == "embedding"
            assert np.array_equal(np.asarray(d["embedding"], dtype=np.float32), e.embedding)
        assert body["usage"]["prompt_tokens"] == sum(len(e.prompt_ids) for e in expected)
    assert "body.dimensions 8 is not this job's embedding length 16" in got["dims"]["error"]["message"]
    assert "encoding_format 'base64' is not supported" in got["b64"]["error"]["message"]
    assert "body.input must be a non-empty" in got["empty"]["error"]["message"]
    assert "url '/v1/chat/completions' is not supported by --task embed" in got["chat"]["error"]["message"]
    assert got["chat"]["response"]["status_code"] == 400


def test_a_lost_part_is_redone_and_append_takes_new_rows_for_a_task_job(tiny_model_dir, tmp_path):
    out, before = job(tmp_path, tiny_model_dir, "score", max_model_len=64)
    parts = sorted(out.glob("part-*.parquet"))
    parts[0].unlink()  # a part lost: its rows are redone, the same
    _, again = job(tmp_path, tiny_model_dir, "score", max_model_len=64)
    assert again == before
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write(json.dumps({"rid": "new", "text": "river stone", "topic": "river", "answer": " x"}) + "\n")
    spec = make_spec(
        input=[str(tmp_path / "rows.jsonl")],
        output=str(out),
        model=str(tiny_model_dir),
        task="score",
        id_column="rid",
        max_model_len=64,
    )
    with pytest.raises(Exception, match="--append"):
        run_job(spec)
    spec.append = True
    assert run_job(spec).status == "complete"
    rows = rows_of(out)
    new = next(r for r in rows if r["rid"] == "new")
    (expected,) = Engine.from_pretrained(str(tiny_model_dir), task="score", max_model_len=64).score(
        ["river stone"]
    )
    assert new["logprob"] == expected.logprob and new["error"] is None
    assert [r for r in rows if r["rid"] != "new"] == before
