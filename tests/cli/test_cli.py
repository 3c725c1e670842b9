"""The command line: every mistake exits 2 with a one-line message and no traceback; run, status, validate."""

from __future__ import annotations

import json
import re
import shutil

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.job.kernels import ROUNDING_FLAGS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": f"x{i}", "review": f"great product {i}", "n": i}) + "\n")
    return path


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def test_run_status_validate_and_job_file(data, tiny_model_dir, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in.jsonl"\noutput = "out"\nmodel = "{tiny_model_dir}"\ntemplate = "Review: {{review}}"\n'
        'max-new-tokens = 3\nid_column = "id"\n'
    )
    code, text = invoke("validate", job)
    assert code == 0 and "ok:" in text and "starts a new job" in text
    code, text = invoke("run", job, "--max-new-tokens", "5")  # the command line overrides the job file
    assert code == 0, text
    table = ds.dataset(tmp_path / "out", format="parquet").to_table()
    assert table.column_names == [
        "id",
        "review",
        "n",
        "generated_text",
        "finish_reason",
        "num_prompt_tokens",
        "num_generated_tokens",
        "error",
    ]
    assert sorted(table.column("id").to_pylist()) == [f"x{i}" for i in range(6)]
    assert max(table.column("num_generated_tokens").to_pylist()) <= 5
    code, text = invoke("status", tmp_path / "out")
    assert code == 0 and "complete" in text and "rows: 6 of 6" in text
    stats = json.loads((tmp_path / "out" / "_batchjob" / "stats.json").read_text())["body"]
    assert stats["rows"] == 6 and stats["latency_s"]["count"] == 6 and stats["batch_occupancy"]["timeline"]
    code, text = invoke("run", job, "--max-new-tokens", "5")
    assert code == 0 and "already complete" in text
    code, text = invoke("run", job)  # max_new_tokens 3 now: a different job
    assert code == 2 and "max_new_tokens: was 5, now 3" in text


def test_a_resume_under_other_kernels_is_refused_naming_it(data, tiny_model_dir, tmp_path, monkeypatch):
    """Other kernels round a job's floats otherwise: a generation job with --logprobs resumed with
    BATCHJOB_CPU_KERNEL=0 wrote 59 of 60 rows' log-probabilities otherwise, without a word; and a task job's
    --compile was never recorded (True == 1 fell among the defaults)."""
    out = tmp_path / "out"
    base = ["run", "--input", data, "--output", out, "--model", tiny_model_dir, "--template", "{review}"]
    base += ["--id-column", "id", "--max-new-tokens", "2", "--logprobs", "1"]
    code, text = invoke(*base)
    assert code == 0, text
    saved = json.loads((out / "_batchjob" / "job.json").read_text())["body"]["fingerprint"]
    assert saved["kernels"] == {}  # recorded, if empty: a job an earlier batchjob started has no entry
    for name in ROUNDING_FLAGS:
        monkeypatch.setenv(name, "off")
        code, text = invoke(*base)
        assert code == 2 and f"kernels.{name}: was on, now off" in text, text
        assert f"unset {name} in the environment" in text, text
        monkeypatch.delenv(name)
    for name in ("BATCHJOB_CPU_JOINT", "BATCHJOB_CPU_ROWS", "BATCHJOB_CPU_HEAP"):  # the same floats
        monkeypatch.setenv(name, "0")
        code, text = invoke(*base)
        assert code == 0 and "already complete" in text, text
        monkeypatch.delenv(name)
    code, text = invoke(*base, "--attention-backend", "torch")
    assert code == 2 and "kernels.attention_backend: was None, now 'torch'" in text, text
    monkeypatch.setenv("BATCHJOB_CPU_KERNEL", "0")
    other = [*base[:4], tmp_path / "out2", *base[5:]]
    code, text = invoke(*other)
    assert code == 0, text
    monkeypatch.delenv("BATCHJOB_CPU_KERNEL")
    code, text = invoke(*other)
    assert code == 2 and "kernels.BATCHJOB_CPU_KERNEL: was off, now on" in text, text
    assert "set BATCHJOB_CPU_KERNEL=0 in the environment to resume" in text, text
    task = ["run", "--input", data, "--output", tmp_path / "t", "--model", tiny_model_dir, "--task", "embed"]
    task += ["--prompt-column", "review", "--id-column", "id"]
    code, text = invoke(*task, "--compile")
    assert code == 0, text
    code, text = invoke(*task)
    assert code == 2 and "task.kernels.compile: was True, now None" in text, text


def test_a_folder_s_files_of_another_format_are_named_when_the_job_starts(data, tiny_model_dir, tmp_path):
    """A folder of .jsonl and .csv files: the .csv rows went unprocessed without a word (validate lists it)."""
    (tmp_path / "more.csv").write_text("review\nfine\n")
    args = ["--input", tmp_path, "--output", tmp_path / "out", "--model", tiny_model_dir, "--max-new-tokens", "2"]
    code, text = invoke("run", *args, "--template", "{review}")
    assert code == 0, text
    assert f"the inputs left out 1 file(s) of another format, e.g. {tmp_path / 'more.csv'}" in text
    hive = tmp_path / "hive" / "lang=en"  # Spark's and Ray Data's partition folders: not read as columns
    hive.mkdir(parents=True)
    shutil.copy(data, hive / "part.jsonl")
    args[1], args[3] = tmp_path / "hive", tmp_path / "out2"
    code, text = invoke("run", *args, "--template", "{review}")
    assert code == 0 and "lang=en/part.jsonl: a folder named key=value (a hive partition) is no column" in text


def test_a_stop_string_holding_a_special_token_is_refused_before_work(data, tiny_model_dir, tmp_path):
    """validate said ok and every row was its error: the output text leaves the token out."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token
    args = ["--input", data, "--output", tmp_path / "out", "--model", tiny_model_dir, "--template", "{review}"]
    for command in ("validate", "run"):
        code, text = invoke(command, *args, "--stop", f"x{end}")
        assert code == 2 and f"--stop: stop string 'x{end}' holds the special token {end!r}" in text, text
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))
    # and so is --max-reasoning-tokens for a model whose tokenizer names no think tags (validate said ok)
    code, text = invoke("validate", *args, "--max-reasoning-tokens", "5")
    assert code == 2 and "--max-reasoning-tokens needs the model's think tags" in text, text


def test_max_errors_stops_with_exit_1(tmp_path, tiny_model_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join('{"text": null}\n' if i % 2 else '{"text": "ok"}\n' for i in range(40)))
    code, text = invoke(
        "run",
        "--input",
        path,
        "--output",
        tmp_path / "o",
        "--model",
        tiny_model_dir,
        "--max-new-tokens",
        "2",
        "--max-errors",
        "3",
    )
    assert code == 1 and "--max-errors 3" in text and "Traceback" not in text
    assert (tmp_path / "o" / "_batchjob" / "manifest.jsonl").exists()
    code, text = invoke(
        "run",
        "--input",
        path,
        "--output",
        tmp_path / "o",
        "--model",
        tiny_model_dir,
        "--max-new-tokens",
        "2",
        "--max-errors",
        "100",
    )
    assert code == 0, text
    table = ds.dataset(tmp_path / "o", format="parquet").to_table()
    assert table.num_rows == 40 and table.column("error").null_count == 20


def test_max_errors_counts_the_failed_rows_of_every_worker(tmp_path, tiny_model_dir):
    """Four workers, one bad row each (rows 0-3: chunks of one row), --max-errors 2: the job stops at its
    second failed row, whichever worker meets it (each counted only its own: all four went on, 4 errors)."""
    path = tmp_path / "bad.jsonl"
    path.write_text("".join('{"text": null}\n' if i < 4 else '{"text": "ok"}\n' for i in range(40)))
    args = ["--input", path, "--output", tmp_path / "o", "--model", tiny_model_dir, "--max-new-tokens", "2"]

    def worker(i, limit):
        return invoke("run", *args, "--max-errors", limit, "--num-shards", "4", "--shard-index", i)

    code, text = worker(0, 2)
    assert code == 0 and "(1 errors)" in text, text
    code, text = worker(1, 2)
    assert code == 1 and "stopped after 2 failed rows in the job (1 in this worker's share, 1 in the" in text
    code, text = worker(2, 2)
    assert code == 1 and "stopped after 3 failed rows in the job" in text
    assert all(worker(i, 10)[0] == 0 for i in range(4))  # a higher limit: every worker goes on to the end
    table = ds.dataset(tmp_path / "o", format="parquet").to_table()
    assert table.num_rows == 40 and table.column("error").null_count == 36


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "{tmp}/missing.jsonl"], "does not exist"),
        (["--output", "{data}"], "is a file"),
        (["--prompt-column", "nope"], "no such column"),
        (["--template", "Hi {nope}"], "no such column"),
        (["--messages-column", "nope"], "no such column"),
        (["--id-column", "nope"], "no such column"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--min-p", "1.5"], "min_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--max-new-tokens", "many"], "not a valid integer"),
        (["--seed", "-1"], "seed"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--block-size", "0"], "block_size"),
        (["--kv-memory-gb", "0"], "kv_memory_gb"),
        (["--checkpoint-interval", "0"], "checkpoint_interval"),
        (["--max-errors", "0"], "max_errors"),
        (["--dtype", "int8"], "int8"),
        (["--device", "tpu"], "device"),
        (["--model", "{tmp}/no-such-model"], "not found"),
        (["--prompt-column", "review", "--template", "{review}"], "exclude each other; both were given on the command line"),
        (["--no-such-option"], "No such option"),
    ],
)
def test_command_line_mistakes_exit_2_without_traceback(args, message, data, tiny_model_dir, tmp_path):
    base = {
        "--input": str(data),
        "--output": str(tmp_path / "out"),
        "--model": str(tiny_model_dir),
        "--template": "{review}",
    }
    args = [a.replace("{tmp}", str(tmp_path)).replace("{data}", str(data)) for a in args]
    for key in ("--input", "--output", "--model", "--template"):
        if key in args or (key == "--template" and {"--prompt-column", "--messages-column"} & set(args)):
            base.pop(key, None)
    full = ["run", *[x for kv in base.items() for x in kv], *args]
    code, text = invoke(*full)
    assert code == 2, text
    assert message in text and "Traceback" not in text
    assert not (tmp_path / "out" / "part-000000.parquet").exists()


def test_no_prompt_column_names_the_columns(data, tiny_model_dir, tmp_path):
    code, text = invoke("run", "--input", data, "--output", tmp_path / "o", "--model", tiny_model_dir)
    assert code == 2 and "columns: id, review, n" in text


def test_output_folder_with_other_files_is_refused(data, tiny_model_dir, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "mine.txt").write_text("keep me")
    code, text = invoke(
        "run",
        "--input",
        data,
        "--output",
        tmp_path / "o",
        "--model",
        tiny_model_dir,
        "--template",
        "{review}",
    )
    assert code == 2 and "already holds other files" in text


def test_status_and_validate_errors(tmp_path):
    code, text = invoke("status", tmp_path)
    assert code == 2 and "holds no batchjob job" in text
    bad = tmp_path / "bad.toml"
    bad.write_text("max_new_tokens = \n")
    code, text = invoke("validate", bad)
    assert code == 2 and "not valid TOML" in text
    bad.write_text("max_new_tokenz = 3\n")
    code, text = invoke("validate", bad)
    assert code == 2 and "unknown field 'max_new_tokenz'" in text
    rows = tmp_path / "rows.parquet"  # an input given where the job file goes: the refusal says which option
    rows.write_bytes(b"PAR1\x00\xac")
    code, text = invoke("run", rows)
    assert code == 2 and f"an input file? give it as --input {rows}" in text


@pytest.mark.timeout(300)
def test_status_of_a_running_job_says_so_with_its_rows_in_flight(launch, tiny_model_dir, tmp_path):
    """`status` while a run is active: it names the running process (from the lock file) and shows what the
    run has in flight beyond its committed rows; once the run stops, it says stopped."""
    import signal

    from tests.faultproc import wait_for_points

    data = tmp_path / "rows.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"r{i}", "review": f"review number {i}"}) + "\n")
    out = tmp_path / "out"
    args = [
        "--input", data, "--output", out, "--model", tiny_model_dir, "--template", "{review}",
        "--max-new-tokens", "6", "--max-num-seqs", "4", "--checkpoint-interval", "0.001",
    ]  # fmt: skip
    proc = launch([str(a) for a in args], BATCHJOB_FAULT_PAUSE="part_committed")
    try:
        [pid], _ = wait_for_points(proc)  # paused mid-job: its first part committed
        code, text = invoke("status", out)
        assert code == 0, text
        assert f"{out}: incomplete, running now (pid {pid} on " in text, text
        live = re.search(
            r"in flight: (\d+) more rows finished, not yet committed; (\d+) in the engine \(up to 4 at a time", text
        )
        assert live and int(live.group(2)) > 0, text  # rows the committed count does not show yet
        assert "rows: " in text and " of 40 input rows" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, output
    code, text = invoke("status", out)
    assert (
        code == 0 and f"{out}: incomplete\n" in text and "running now" not in text and "in flight" not in text
    )
    assert "without committing" not in text, text  # a clean stop committed what it had finished


BF16_HINT = "this CPU computes bf16 natively"  # the start of engine/cpu/bf16.py's FASTER_BF16


@pytest.mark.parametrize("native", [True, False])
def test_a_new_job_at_the_default_dtype_hears_of_bf16_only_where_the_cpu_has_it(
    monkeypatch, native, data, tiny_model_dir, tmp_path
):
    """Left to the engine, the CPU's dtype is float32; where bf16 is native (and 1.9-2.8x faster) a new job
    says so in one line. A dtype given (float32 too) or a CPU without native bf16: not a word."""
    from batchjob.engine.cpu import bf16

    monkeypatch.setattr(bf16, "native_bf16", lambda: native)
    args = ["--input", data, "--model", tiny_model_dir, "--template", "{review}", "--max-new-tokens", 2]
    code, text = invoke("run", *args, "--output", tmp_path / "default")
    assert code == 0, text
    assert text.count(BF16_HINT) == int(native), text
    code, text = invoke("run", *args, "--output", tmp_path / "given", "--dtype", "float32")
    assert code == 0 and BF16_HINT not in text, text


def test_the_bf16_line_is_not_said_on_a_resume_nor_for_a_task(monkeypatch, tiny_model_dir, tmp_path):
    """A resumed job keeps its recorded dtype (another one is refused), and a prefill-only task was not what
    the line's figures measured: neither hears it, on a CPU with native bf16."""
    from batchjob.engine.cpu import bf16

    monkeypatch.setattr(bf16, "native_bf16", lambda: True)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join('{"text": null}\n' if i % 2 else '{"text": "ok"}\n' for i in range(20)))
    args = ["--input", path, "--output", tmp_path / "o", "--model", tiny_model_dir, "--max-new-tokens", 2]
    code, text = invoke("run", *args, "--max-errors", 1)  # stops partway: the rerun resumes it
    assert code == 1 and text.count(BF16_HINT) == 1, text
    code, text = invoke("run", *args, "--max-errors", 100)
    assert code == 0 and BF16_HINT not in text, text
    task = ["--input", path, "--output", tmp_path / "s", "--model", tiny_model_dir, "--task", "score"]
    code, text = invoke("run", *task)
    assert code == 0 and BF16_HINT not in text, text


@pytest.mark.timeout(300)
def test_run_in_bf16_says_its_cost_and_resume_refuses_a_changed_dtype(launch, data, tiny_model_dir, tmp_path):
    """`batchjob run --dtype bfloat16` in a real process: on a CPU without native bf16 its output carries the
    engine's one warning line (slower than float32); the job records its dtype, and a rerun with another
    dtype is refused before work, naming the change."""
    import torch

    from batchjob.engine.cpu import bf16

    out = tmp_path / "out"
    args = [
        "--input", data, "--output", out, "--model", tiny_model_dir, "--template", "{review}",
        "--max-new-tokens", "3", "--device", "cpu",
    ]  # fmt: skip
    proc = launch([str(a) for a in [*args, "--dtype", "bfloat16"]])
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, output
    slow = bf16.slow_bf16(torch.device("cpu"), torch.bfloat16)
    if slow is None:  # a CPU with native bf16: nothing to say
        assert "no native bf16" not in output
    else:
        assert output.count(slow) == 1, output
    code, text = invoke("run", *args, "--dtype", "float32")
    assert code == 2 and "model.dtype: was 'bfloat16', now 'float32'" in text, text
    code, text = invoke("run", *args, "--dtype", "bfloat16")
    assert code == 0 and "already complete" in text, text
