"""Prefill-only task jobs with LoRA adapters (``--task score|classify|embed --lora ... --adapter-column``):
each row's result equals PEFT's model under the row's adapter (float64; base rows the base model's), the
``adapter`` column, an unknown name an error row, status per adapter, and a kill -9 then resume that writes
what an uninterrupted run did."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest
import torch

from batchjob.engine.engine import Engine
from tests.jobproc import read_results, run_here
from tests.task_models import make_classifier, make_embedder
from tests.tiers import engine_fixture

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(600)

WORDS = ["great", "terrible", "fine", "broke", "love", "quality", "price", "arrived", "slow", "cheap"]
ADAPTER_OF_ROW = [None, "a", "b", "", "a", "b", None, "b", "a", "nope", "b", "a"]


def _save(model, out, seed, **config):
    torch.manual_seed(seed)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config)).save_pretrained(str(out))
    return out


@engine_fixture(scope="module")
def task_models(tiny_model_dir, tmp_path_factory):
    """task -> (model folder, {adapter name: PEFT folder}, loader of the model as PEFT takes it)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("task-lora")
    clf = make_classifier(root / "bert-clf", "bert", 3)
    emb = make_embedder(root / "bert-emb", "bert", "mean")
    made = {
        "score": (tiny_model_dir, AutoModelForCausalLM, (["q_proj", "v_proj"], ["o_proj", "down_proj"]), {}),
        "classify": (
            clf,
            AutoModelForSequenceClassification,
            (["query"], ["value", "dense"]),
            {"task_type": "SEQ_CLS"},
        ),
        "embed": (emb, AutoModel, (["query", "value"], ["dense"]), {"task_type": "FEATURE_EXTRACTION"}),
    }
    out = {}
    for task, (folder, auto, (first, second), extra) in made.items():

        def load(folder=folder, auto=auto):
            return auto.from_pretrained(str(folder))

        adapters = {
            "a": _save(load(), root / task / "a", 1, r=4, lora_alpha=8, target_modules=first, **extra),
            "b": _save(load(), root / task / "b", 2, r=2, lora_alpha=5, target_modules=second, **extra),
        }
        out[task] = folder, adapters, load
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    with open(path, "w") as f:
        for i, adapter in enumerate(ADAPTER_OF_ROW):
            text = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + i % 7))
            f.write(json.dumps({"rid": f"r{i:02d}", "text": text, "adapter": adapter}) + "\n")
    return path


def _args(rows, out, folder, adapters, task, *extra, dtype="float64") -> list[str]:
    args = ["--input", rows, "--output", out, "--model", folder, "--task", task, "--id-column", "rid"]
    args += ["--adapter-column", "adapter", "--dtype", dtype, "--max-num-batched-tokens", "16"]
    for name, path in adapters.items():
        args += ["--lora", f"{name}={path}"]
    return [str(a) for a in [*args, *extra]]


def _peft_result(load, adapter, ids: list[int], task: str):
    model = load()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model = model.double().eval()
    with torch.no_grad():
        if task == "score":
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            return float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        if task == "classify":
            return model(torch.tensor([ids])).logits[0].numpy()
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()  # the folder's mean, normalized


@pytest.mark.parametrize("task", ["score", "classify", "embed"])
def test_task_job_under_adapters_equals_peft(task_models, rows, tmp_path, task):
    folder, adapters, load = task_models[task]
    code, text = run_here(_args(rows, tmp_path / "out", folder, adapters, task))
    assert code == 0, text
    got = {r["rid"]: r for r in read_results(tmp_path / "out")}
    assert len(got) == len(ADAPTER_OF_ROW)
    assert "unknown LoRA adapter 'nope'" in got["r09"]["error"]
    texts = [json.loads(line)["text"] for line in rows.read_text().splitlines()]
    tokenize = Engine.from_pretrained(str(folder), task=task, device="cpu").tokenize
    for i, name in enumerate(ADAPTER_OF_ROW):
        r = got[f"r{i:02d}"]
        if name == "nope":
            continue
        assert r["error"] is None and r["adapter"] == (name or None)
        ref = _peft_result(load, adapters.get(name or ""), tokenize(texts[i]), task)
        if task == "score":
            assert r["logprob"] == pytest.approx(ref, abs=1e-10)
        else:
            value = np.asarray(r["scores" if task == "classify" else "embedding"], dtype=np.float64)
            assert np.abs(value - ref).max() <= 1e-6 * max(1.0, float(np.abs(ref).max())), name
    if task == "score":  # the adapters are in the job's identity by content: another folder is refused
        swapped = {"a": adapters["b"], "b": adapters["b"]}
        code, text = run_here(_args(rows, tmp_path / "out", folder, swapped, task))
        assert code == 2 and "lora.a" in text, text
    # status: each adapter's committed rows and errors (the unknown name's row failed before it ran: its own)
    from click.testing import CliRunner

    from batchjob.cli import main

    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    found = re.findall(r"^  (\S.*?)\s+(\d+) rows, (\d+) errors, (\d+) tokens read$", status, re.MULTILINE)
    counts = {label: (int(n), int(e)) for label, n, e, _ in found}
    unrun = "(no adapter: failed before it ran)"
    assert counts == {"(base model)": (3, 0), "a": (4, 0), "b": (4, 0), unrun: (1, 1)}, status
    read = {label: int(t) for label, _, _, t in found if label != unrun}
    for label, name in (("(base model)", None), ("a", "a"), ("b", "b")):
        mine = [r for r in got.values() if r["adapter"] == name and r["error"] is None]
        assert read[label] == sum(r["num_prompt_tokens"] for r in mine) > 0
    if task == "classify":  # the report's table: the same counts, each adapter's tokens read per second
        from batchjob.job.report import build

        page = build([tmp_path / "out"]).read_text()
        table = page[page.index('<table id="adapters">') :]
        table = table[: table.index("</table>")]
        assert "<th>tokens read/s (last run)</th>" in table
        for label, n in read.items():  # each adapter read its tokens in the one run: a rate of its own
            cells = rf"<tr><td>{re.escape(label)}</td><td>\d</td><td>0</td><td>{n:,}</td><td>0</td>"
            found = re.search(cells + r"<td>([\d.]+)</td>", table)
            assert found and float(found.group(1)) > 0, table


def test_killed_score_job_with_adapters_resumes_to_the_uninterrupted_results(
    launch, task_models, rows, tmp_path
):
    """float32 with the prefix cache on: which rows (and adapters) share a step differs between the runs."""
    from tests.faultproc import wait_for_points, wait_gone

    folder, adapters, _ = task_models["score"]
    extra = ["--block-size", "4", "--max-num-seqs", "3", "--checkpoint-interval", "0.001"]
    code, text = run_here(_args(rows, tmp_path / "ref", folder, adapters, "score", *extra, dtype="float32"))
    assert code == 0, text
    args = _args(rows, tmp_path / "out", folder, adapters, "score", *extra, dtype="float32")
    proc = launch(args, BATCHJOB_FAULT_PAUSE="part_committed")
    [pid], _ = wait_for_points(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not wait_gone([pid])
    assert 0 < len(read_results(tmp_path / "out")) < len(ADAPTER_OF_ROW)
    code, text = run_here(args)
    assert code == 0, text
    assert read_results(tmp_path / "out") == read_results(tmp_path / "ref")
