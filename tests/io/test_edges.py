"""The edges where a labeling tool could give a silent wrong answer (issue 31): input columns named like
result columns, inputs that change under a running job, exports of every task, odd model configs, and the
small messages around them. Each case either works exactly or refuses by name."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.errors import InputError
from batchjob.io.schema import input_schema
from batchjob.io.sources import discover
from batchjob.io.writers import RENAMED_KEY, input_column, output_names, output_schema, task_fields
from batchjob.job import make_spec, run_job

pytestmark = pytest.mark.timeout(300)


# --- input columns named like result columns -------------------------------------------------------------


def test_a_clashing_input_column_is_prefixed_until_its_name_is_free():
    names = output_names(["error", "input_error", "input_input_error", "text", "generated_text"])
    assert names == {
        "error": "input_input_input_error",
        "input_error": "input_error",
        "input_input_error": "input_input_error",
        "text": "text",
        "generated_text": "input_generated_text",
    }
    schema = pa.schema([(n, pa.string()) for n in names])
    out = output_schema(schema)
    assert len(set(out.names)) == len(out.names)
    assert json.loads(out.metadata[RENAMED_KEY]) == {
        "input_input_input_error": "error",
        "input_generated_text": "generated_text",
    }
    # read back by the record: the input's "error" is not the result's
    assert input_column(out, "error") == "input_input_input_error"
    assert input_column(out, "input_error") == "input_error"
    assert input_column(out, "text") == "text"


def test_the_naming_rule_keeps_unclashing_names_and_other_tasks_names():
    plain = output_schema(pa.schema([("text", pa.string())]))
    assert plain.names[0] == "text" and plain.metadata is None  # nothing renamed: nothing recorded
    # "label" is a classify result, not generation's: kept, and recorded as kept, beside an "input_label"
    both = output_schema(pa.schema([("label", pa.string()), ("input_label", pa.string())]))
    assert both.names[:2] == ["label", "input_label"]
    assert input_column(both, "label") == "label"
    classify = output_schema(
        pa.schema([("label", pa.string()), ("input_label", pa.string())]),
        result=task_fields("classify", num_labels=3),
    )
    assert classify.names[:2] == ["input_input_label", "input_label"]
    assert input_column(classify, "label") == "input_input_label"
    # a part written before the record: the single prefix it had then
    legacy = pa.schema([("input_error", pa.string()), ("error", pa.string())])
    assert input_column(legacy, "error") == "input_error"


def test_an_input_file_with_two_columns_of_one_name_is_refused_by_name(tmp_path):
    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["x", "x"]), path)
    pq.write_table(pa.table({"x": ["c"]}), tmp_path / "ok.parquet")
    with pytest.raises(InputError, match=r"dup\.parquet has more than one column named 'x'"):
        input_schema(discover([str(tmp_path)]))


def test_a_jsonl_row_that_gives_a_key_twice_is_an_error_row_naming_key_file_and_line(tmp_path):
    from batchjob.io.readers import iter_rows

    data = tmp_path / "rows.jsonl"
    data.write_text('{"a": 1, "b": 2}\n{"a": 1, "b": 2, "a": 3}\n{"a": {"x": 1, "x": 2}}\n')
    rows = list(iter_rows(discover([str(data)])))
    assert [r.values for r in rows] == [{"a": 1, "b": 2}, None, None]
    assert rows[1].error == "rows.jsonl line 2: key 'a' appears more than once in an object (which value is meant?)"
    assert rows[2].error.startswith("rows.jsonl line 3: key 'x' appears more than once")


def test_export_refuses_a_part_an_earlier_version_wrote_with_two_columns_of_one_name(tmp_path):
    from batchjob.errors import StateError
    from batchjob.job.export import _part_rows
    from batchjob.job.manifest import PartRecord

    arrays = [pa.array(["in"]), pa.array(["ie"]), pa.array([None], pa.string())]
    pq.write_table(pa.Table.from_arrays(arrays, names=["input_error", "input_error", "error"]), tmp_path / "p.parquet")
    record = PartRecord("p.parquet", 1, 0, 0, 0, [[0, 1]])
    with pytest.raises(StateError, match=r"part p\.parquet has more than one column named 'input_error'"):
        list(_part_rows(tmp_path, record))


def _job(tmp_path, model, rows, **kw):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    if kw.get("task", "generate") == "generate":
        kw.setdefault("max_new_tokens", 2)
    spec = make_spec(input=[str(data)], output=str(out), model=str(model), chat=False, **kw)
    assert run_job(spec).status == "complete"
    return out


def test_input_error_columns_survive_the_parts_and_the_export(tiny_model_dir, tmp_path):
    rows = [{"error": f"e{i}", "input_error": f"ie{i}", "text": f"row {i}"} for i in range(3)]
    out = _job(tmp_path, tiny_model_dir, rows, template="{text} {error}", id_column="error")
    table = ds.dataset(out, format="parquet").to_table()  # readable: no two fields of one name
    assert table.column("input_input_error").to_pylist() == ["e0", "e1", "e2"]
    assert table.column("input_error").to_pylist() == ["ie0", "ie1", "ie2"]
    assert table.column("error").to_pylist() == [None, None, None]
    result = CliRunner().invoke(main, ["export", str(out), "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    exported = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["input_input_error"] for r in exported] == ["e0", "e1", "e2"]
    assert [r["input_error"] for r in exported] == ["ie0", "ie1", "ie2"]
    result = CliRunner().invoke(main, ["export", str(out), "--format", "openai"])
    assert result.exit_code == 0, result.output
    # the --id-column "error" is the input's, not the result's (null) error
    assert [json.loads(line)["custom_id"] for line in result.stdout.splitlines()] == ["e0", "e1", "e2"]


# --- inputs that change under a running job ---------------------------------------------------------------


def _lines(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"rid": f"r{i:04d}", "review": f"item {i} was {'good' if i % 3 else 'bad'}"}) + "\n")
    return path


def _run_args(data, out, model):
    args = ["--input", data, "--output", out, "--model", model, "--template", "Review: {review}\nSentiment:"]
    args += ["--id-column", "rid", "--max-new-tokens", "2", "--max-num-seqs", "2"]
    return [str(a) for a in [*args, "--checkpoint-interval", "0.000001"]]  # a part each step


@pytest.mark.parametrize(
    "change, said",
    [
        ("append", "grew from 155 to 188 bytes (is something still writing to it?)"),
        ("remove", "was removed"),
        ("replace", "was replaced by another file"),
        ("rewrite", "was modified (its time stamp changed)"),
    ],
)
def test_the_reader_stops_at_the_end_of_a_file_that_changed_while_read(tmp_path, change, said):
    import os

    from batchjob.io.readers import iter_rows
    from batchjob.io.watch import InputChangedWhileReadError

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i:03d} " + "x" * 10}) + "\n" for i in range(5)))
    assert data.stat().st_size == 155
    rows = iter_rows(discover([str(data)]))
    assert next(rows).values is not None  # the reader has the file open
    if change == "append":
        with open(data, "a") as f:
            f.write(json.dumps({"text": "row 005 " + "x" * 12}) + "\n")
    elif change == "remove":
        data.unlink()
    elif change == "replace":
        other = tmp_path / "other.jsonl"
        other.write_text(data.read_text())
        os.replace(other, data)
    else:
        st = data.stat()
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(InputChangedWhileReadError) as e:
        list(rows)
    assert str(e.value).startswith(f"input {data} {said} while it was being read")
    hint = "--append" if change == "append" else "Restore the file the job started with"
    assert hint in str(e.value)


def test_an_input_truncated_in_place_while_read_stops_the_job(launch, tiny_model_dir, tmp_path):
    """logrotate's copytruncate: the file is cut to 0 bytes once the first part is committed, while the
    reader is part-way through it. The job must not say complete over the rows it happened to see."""
    data = _lines(tmp_path / "log.jsonl", 2000)
    size = data.stat().st_size
    out = tmp_path / "out"
    proc = launch(
        _run_args(data, out, tiny_model_dir), BATCHJOB_FAULT_TRUNCATE=f"part_committed:0:{data}"
    )
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 2, output
    assert f"input {data} shrank from {size} to 0 bytes" in output
    assert "copytruncate" in output and "new --output" in output
    assert "complete:" not in output and "Traceback" not in output
    from batchjob.job.state import StateDir

    assert not StateDir(out).load_job().complete


def test_an_input_changed_after_it_was_read_stops_the_job_before_complete(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The reader was done with the file (4 rows, all read at once) when it was cut: the check before
    "complete" finds it, by the job's records."""
    from tests.jobproc import run_here

    data = _lines(tmp_path / "small.jsonl", 4)
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHJOB_FAULT_TRUNCATE", f"part_committed:10:{data}")
    code, output = run_here(_run_args(data, out, tiny_model_dir))
    assert code == 2, output
    assert "the job stopped before saying complete" in output
    assert f"{data}: changed (shrank from" in output
    assert "complete:" not in output and "Traceback" not in output
    monkeypatch.delenv("BATCHJOB_FAULT_TRUNCATE")
    code, output = run_here(_run_args(data, out, tiny_model_dir))  # and a rerun refuses, by the same records
    assert code == 2 and "changed since it started" in output, output


def test_a_file_added_to_an_input_folder_while_the_job_ran_stops_it_before_complete(tiny_model_dir, tmp_path):
    """The check before "complete" looked again only at the files found at the start: a file added to the
    --input folder meanwhile went unread, and the run said "complete: 20 of 20" (a rerun refused it as new)."""
    from tests.jobproc import at_step, run_here

    (tmp_path / "in").mkdir()
    _lines(tmp_path / "in" / "a.jsonl", 20)
    out = tmp_path / "out"
    added = tmp_path / "in" / "b.jsonl"
    args = _run_args(tmp_path / "in", out, tiny_model_dir)[:-2]  # no checkpoint before the end
    with at_step(2, lambda: _lines(added, 3)):
        code, output = run_here(args)
    assert code == 2, output
    assert "the job stopped before saying complete" in output
    assert f"{added}: new file (run with --append to process it)" in output
    assert "complete:" not in output and "Traceback" not in output
    # the 20 rows of the file it recorded were done and are kept (they were dropped: the last part was
    # committed after the check, so the --append run did them again)
    code, output = run_here([*args, "--append"])
    assert code == 0 and "complete: 23 of 23" in output, output
    assert "this run: 3 rows" in output, output


# --- export ------------------------------------------------------------------------------------------------


def _export(out, *args):
    result = CliRunner().invoke(main, ["export", str(out), *map(str, args)])
    return result.exit_code, result.output


def test_openai_export_of_a_score_job_is_refused_by_name_and_leaves_no_file(tiny_model_dir, tmp_path):
    out = _job(tmp_path, tiny_model_dir, [{"text": "a b c d"}], template="{text}", task="score")
    target = tmp_path / "lines.jsonl"
    code, output = _export(out, "--format", "openai", "--to", target)
    assert code == 2, output
    assert "--format openai: a score job's results have no OpenAI Batch response" in output
    assert "--format jsonl or csv" in output and "Traceback" not in output
    assert list(tmp_path.glob("*lines.jsonl*")) == []  # neither the target nor its temporary file
    code, output = _export(out, "--format", "jsonl", "--to", target)
    assert code == 0 and target.exists(), output


def test_export_to_a_missing_folder_names_the_path_given(tiny_model_dir, tmp_path):
    out = _job(tmp_path, tiny_model_dir, [{"text": "a b"}], template="{text}")
    for target in (tmp_path / "nowhere" / "x.jsonl", tmp_path / "gone" / "deeper" / "x.jsonl"):
        code, output = _export(out, "--format", "jsonl", "--to", target)
        assert code == 2, output
        assert f"--to {target}: cannot write in {target.parent}" in output, output
        assert ".tmp" not in output and "Traceback" not in output
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "x.jsonl"
    code, output = _export(out, "--format", "jsonl", "--to", target)
    assert code == 2 and f"--to {target}: cannot write in {target.parent} (Not a directory)" in output, output


def test_openai_export_a_row_too_long_for_the_model_is_a_bad_request(tiny_model_dir, tmp_path):
    """Refused by the engine at admission (it has prompt tokens): still the request's fault, 400."""
    rows = [{"text": "short"}, {"text": " ".join(["word"] * 200)}]
    out = _job(tmp_path, tiny_model_dir, rows, template="{text}", task="embed", max_model_len=32)
    code, output = _export(out, "--format", "openai")
    assert code == 0, output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [line["response"]["status_code"] for line in lines] == [200, 400]
    assert lines[1]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert "longer than the model's limit" in lines[1]["error"]["message"]


# --- models --------------------------------------------------------------------------------------------------


@pytest.fixture
def load_reports():
    """transformers' load reports (warnings of ``transformers.modeling_utils``) that reach its handlers."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "LOAD REPORT" in record.getMessage():
                seen.append(record.getMessage())

    logger, handler = logging.getLogger("transformers.modeling_utils"), Keep()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _copy(folder, to):
    import shutil

    shutil.copytree(folder, to)
    return to


def test_embed_on_a_causal_model_shows_no_load_report_and_missing_weights_are_refused(
    tiny_model_dir, tmp_path, load_reports
):
    """transformers fills weights a checkpoint lacks with random values and only warns: every result would
    be noise. Such a checkpoint is refused naming the weights under embed (and classify, below); generate
    keeps transformers' report (an encoder's folder there is refused by name after the load)."""
    from safetensors.torch import load_file, save_file

    from batchjob.errors import ModelNotFoundError
    from batchjob.models import load_model_and_tokenizer

    load_model_and_tokenizer(str(tiny_model_dir), None, "cpu", task="embed")
    assert load_reports == []  # the LM head left out: nothing is wrong
    broken = _copy(tiny_model_dir, tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if k.endswith("norm.weight") and "layers" not in k)
    del weights[name]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError) as e:
        load_model_and_tokenizer(str(broken), None, "cpu", task="embed")
    assert f"its checkpoint has no {name.removeprefix('model.')}, which transformers" in str(e.value)
    assert str(e.value).endswith("give the model's whole checkpoint") and load_reports == []
    load_model_and_tokenizer(str(broken), None, "cpu", task="generate")
    assert len(load_reports) == 1 and "MISSING" in load_reports[0]  # shown as transformers wrote it


@pytest.mark.engine
def test_classify_on_a_model_without_a_classification_head_is_refused(tmp_path, load_reports):
    """A base model's checkpoint (no classifier) under --task classify got a random head from transformers
    and gave a label for every row: noise. Refused, saying what to give instead; embed takes it (its pooler,
    missing or not, is read by no embedding)."""
    from transformers import AutoModel

    from batchjob.errors import ModelNotFoundError
    from batchjob.models import load_model_and_tokenizer
    from tests.task_models import make_classifier

    folder = make_classifier(tmp_path / "clf", "bert", 2)
    base = tmp_path / "base"
    body = AutoModel.from_pretrained(folder, add_pooling_layer=False)
    body.save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ModelNotFoundError) as e:
        load_model_and_tokenizer(str(base), None, "cpu", task="classify")
    assert str(e.value).startswith(
        f"model folder {base}: its checkpoint has no bert.pooler.dense.bias, bert.pooler.dense.weight, "
        "classifier.bias, classifier.weight, which transformers would fill with random values for --task classify"
    )
    assert "or --task embed for this model's embeddings" in str(e.value)
    load_model_and_tokenizer(str(base), None, "cpu", task="embed")  # no pooler in it: embed does not read one


@pytest.mark.engine
def test_a_classifier_without_id2label_is_refused_naming_the_key(tmp_path, load_reports):
    from batchjob.errors import ModelNotFoundError
    from batchjob.models import load_model_and_tokenizer
    from tests.task_models import make_classifier

    folder = make_classifier(tmp_path / "clf", "bert", 3)
    config = json.loads((folder / "config.json").read_text())
    for key in ("id2label", "label2id"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError) as e:
        load_model_and_tokenizer(str(folder), None, "cpu", task="classify")
    assert str(e.value) == (
        f"model folder {folder}: its classification head (classifier.weight) has 3 outputs, but its config.json "
        "has no id2label, so transformers assumes 2 labels. Set id2label in config.json to the head's 3 labels, "
        'in output order ({"0": "L0", "1": "L1", "2": "L2"}), and label2id to match'
    )
    assert load_reports == []


def test_float16_on_a_cpu_without_it_gets_a_warning_beside_bf16s(monkeypatch):
    import torch

    from batchjob.engine.cpu import bf16

    cpu = torch.device("cpu")
    monkeypatch.setattr(bf16, "native_fp16", lambda: False)
    line = bf16.slow_bf16(cpu, torch.float16)
    assert line is not None and line.startswith("dtype float16: this CPU has no native float16")
    assert "slower than float32" in line
    assert bf16.slow_bf16(torch.device("cuda"), torch.float16) is None
    monkeypatch.setattr(bf16, "native_fp16", lambda: True)
    assert bf16.slow_bf16(cpu, torch.float16) is None


@pytest.mark.parametrize("given", [["--logprobs", "-1"], ["--logprobs=-1"]])
def test_a_negative_logprobs_says_what_values_it_takes(given, tmp_path):
    args = ["run", "--input", str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "o"), *given]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert f"{' '.join(given)}: --logprobs takes a whole number 0 or more, or nothing (--logprobs alone: 0)" in (
        result.output
    )
    assert "No such option" not in result.output


def test_json_text_in_a_column_that_gives_a_key_twice_is_refused_naming_the_key():
    # a column's JSON text (messages, parameters, a request body) is held to the JSONL line's rule
    from batchjob.io.jsontext import loads_text

    for text, key in [
        ('{"a": 1, "a": 2}', "a"),
        ('[{"role": "user", "content": "x", "content": "y"}]', "content"),
    ]:
        with pytest.raises(ValueError, match=f"key '{key}' appears more than once in an object"):
            loads_text(text)
    assert loads_text('{"a": {"a": 1}}') == {"a": {"a": 1}}


@pytest.mark.engine
def test_a_classifier_whose_labels_skip_a_number_is_refused(tmp_path):
    """id2label {0, 2, 5} for a head of 3 outputs: output 1 has no name, and would be labelled '1'."""
    from batchjob import Engine
    from batchjob.errors import ConfigError
    from tests.task_models import make_classifier

    folder = make_classifier(tmp_path / "clf", "bert", 3)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "a", "2": "b", "5": "c"}
    config["label2id"] = {"a": 0, "b": 2, "c": 5}
    (folder / "config.json").write_text(json.dumps(config))
    refused = r"numbers its labels \[0, 2, 5\] in id2label: the head's outputs are 0 to 2"
    with pytest.raises(ConfigError, match=refused):
        Engine.from_pretrained(str(folder), task="classify", device="cpu")
