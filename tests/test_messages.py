"""Messages that say what is true: ``validate`` refuses what ``run`` refuses, with the same words; a file read
twice through a symlink, a bad row, a resumed job's changed setting each say which file, row or value."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.io.atomic import read_json, write_json

pytestmark = pytest.mark.timeout(120)


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def _rows(path, n=2):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"hello {i}"}) + "\n")
    return path


def test_validate_refuses_embed_dimensions_beyond_the_width(tiny_model_dir, tmp_path):
    data = _rows(tmp_path / "in.jsonl")
    common = ("--model", tiny_model_dir, "--input", data, "--output", tmp_path / "out", "--task", "embed")
    code, text = invoke("validate", *common, "--dimensions", "65")  # the tiny llama is 64 wide
    assert code == 2 and "dimensions 65 exceeds the model's width of 64" in text, text
    code, text = invoke("validate", *common, "--dimensions", "64")
    assert code == 0 and "ok:" in text, text


def test_a_file_reached_twice_through_a_symlink_is_read_once(tmp_path):
    from batchjob.io.sources import discover

    (tmp_path / "in" / "a").mkdir(parents=True)
    _rows(tmp_path / "in" / "a" / "f.jsonl")
    (tmp_path / "in" / "link").symlink_to("a")  # a sibling folder, not a loop
    skipped: list = []
    found = discover([str(tmp_path / "in"), str(tmp_path / "in" / "a" / "f.jsonl")], skipped=skipped)
    assert [s.name for s in found] == ["a/f.jsonl"]
    same = [str(s) for s in skipped]
    assert len(same) == 2 and all(f"the same file as {tmp_path}/in/a/f.jsonl" in s for s in same), same


def test_a_file_behind_a_symlinked_subfolder_is_taken_by_the_input_folder(tmp_path):
    """``export --to`` is refused where the next run would read the file (owned.py asks ``takes``): the real
    path behind a symbolic link to a folder outside the input folder counts, as the walk follows it."""
    from batchjob.io.sources import takes

    (tmp_path / "in").mkdir()
    (tmp_path / "other" / "deep").mkdir(parents=True)
    (tmp_path / "in" / "link").symlink_to(tmp_path / "other", target_is_directory=True)
    (tmp_path / "in" / "_hidden").symlink_to(tmp_path / "other", target_is_directory=True)
    target = (tmp_path / "other" / "deep" / "x.jsonl").resolve()
    assert takes(str(tmp_path / "in"), target)
    assert takes(str(tmp_path / "in" / "**" / "*.jsonl"), target)
    assert not takes(str(tmp_path / "in"), target.with_suffix(".txt"))  # not a format it reads
    assert not takes(str(tmp_path / "in" / "*.jsonl"), target)  # the glob does not reach into link/
    (tmp_path / "in" / "link").unlink()
    assert not takes(str(tmp_path / "in"), target)  # only through a hidden name: not read


def test_bad_rows_name_their_file_and_line_and_keep_their_id(tiny_model_dir, tmp_path):
    import pyarrow.dataset as ds

    data = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": ""}).encode(),
        json.dumps({"id": "b", "prompt": "word " * 1200}).encode(),  # beyond the tiny model's 1024 tokens
        b'{"id": "c", "prompt": "ok \xff"}',
        b'{"id": "\xfe", "prompt": "x"}',  # an id with a bad byte: not written as if read
        json.dumps({"id": "d", "prompt": "fine"}).encode(),
    ]
    data.write_bytes(b"\n".join(lines) + b"\n")
    for task in ("embed", "generate"):
        out = tmp_path / task
        more = ("--max-new-tokens", "1") if task == "generate" else ()
        args = (
            "--model",
            tiny_model_dir,
            "--input",
            data,
            "--output",
            out,
            "--task",
            task,
            "--id-column",
            "id",
        )
        code, text = invoke("run", *args, *more)
        assert code == 0, text
        rows = ds.dataset(out, format="parquet").to_table(columns=["id", "prompt", "error"]).to_pylist()
        errors = [(r["id"], r["prompt"], (r["error"] or "").split(": ")[0]) for r in rows]
        assert errors == [
            ("a", "", "in.jsonl line 1"),
            ("b", "word " * 1200, "in.jsonl line 2"),
            ("c", None, "in.jsonl line 3"),  # the id kept, the damaged values not
            (None, None, "in.jsonl line 4"),
            ("d", "fine", ""),
        ], task
        assert "invalid UTF-8" in rows[2]["error"] and "empty" in rows[0]["error"]


def test_half_a_utf16_pair_in_a_columns_json_text_is_that_rows_error(tiny_model_dir, tmp_path):
    """JSON text in a Parquet column (messages, per-row parameters) may escape half a UTF-16 pair: no
    character, which the tokenizer refused with a TypeError the row's error quoted; now said as it is."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    user = json.dumps([{"role": "user", "content": "hi"}])
    half = '[{"role": "user", "content": "half \\udcff"}]'
    data = tmp_path / "in.parquet"
    twice = '[{"role": "user", "content": "a", "content": "b"}]'  # which content is meant?
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "c", "d"],
                "m": [user, half, user, twice],
                "p": [None, None, '{"stop": "\\ud800"}', None],
            }
        ),
        data,
    )
    out = tmp_path / "out"
    args = ("--model", tiny_model_dir, "--input", data, "--output", out, "--id-column", "id")
    code, text = invoke(
        "run", *args, "--messages-column", "m", "--params-column", "p", "--max-new-tokens", "1"
    )
    assert code == 0, text
    rows = sorted(ds.dataset(out, format="parquet").to_table().to_pylist(), key=lambda r: r["id"])
    assert rows[0]["error"] is None and rows[0]["num_generated_tokens"] == 1
    assert rows[1]["error"] == (
        "in.parquet row 1: column 'm': a lone UTF-16 surrogate escape, not a character, at key 'content': "
        "character 5 (\\udcff)"
    )
    assert "params column 'p': a lone UTF-16 surrogate escape" in rows[2]["error"], rows[2]["error"]
    assert rows[3]["error"] == (
        "in.parquet row 3: column 'm': key 'content' appears more than once in an object (which value is meant?)"
    )


def test_a_line_half_written_after_the_job_recorded_its_file_is_left_to_append(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The reader reads a JSONL file as far as the job recorded it: a half-written line appended after that
    is not made an error row (which --append, going by the record, would not redo); the run stops as the
    file grew, and --append then reads the finished line."""
    import pyarrow.dataset as ds

    from batchjob import faults
    from batchjob.errors import InputError
    from batchjob.job import make_spec, run_job

    data = _rows(tmp_path / "in.jsonl", 40)
    point = faults.point

    def torn_after_recording(name: str) -> None:
        if name == "loop_started":
            with open(data, "a") as f:
                f.write('{"prom')
        point(name)

    monkeypatch.setattr(faults, "point", torn_after_recording)
    options = dict(
        input=[str(data)], output=str(tmp_path / "out"), model=str(tiny_model_dir), max_new_tokens=1
    )
    with pytest.raises(InputError, match="grew"):
        run_job(make_spec(checkpoint_interval=1e-6, **options))
    monkeypatch.setattr(faults, "point", point)
    with open(data, "a") as f:
        f.write('pt": "the end"}\n')
    assert run_job(make_spec(append=True, **options)).status == "complete"
    rows = ds.dataset(tmp_path / "out", format="parquet").to_table(columns=["prompt", "error"]).to_pylist()
    assert len(rows) == 41 and not [r for r in rows if r["error"]], [r for r in rows if r["error"]]


def test_a_resume_that_spells_out_a_default_is_the_same_job_or_says_what_the_default_is(
    tiny_model_dir, tmp_path
):
    from batchjob.job import make_spec, run_job
    from batchjob.job.state import JobMismatchError

    data = _rows(tmp_path / "in.jsonl")
    options = dict(input=[str(data)], output=str(tmp_path / "out"), model=str(tiny_model_dir), task="embed")
    assert run_job(make_spec(**options)).status == "complete"
    # the tiny llama has no sentence-transformers files: normalize's default is off, for this model anywhere
    assert run_job(make_spec(normalize=False, **options)).status == "already complete"
    with pytest.raises(
        JobMismatchError, match=r"task.normalize: was None \(the default: False for this model\), now True"
    ):
        run_job(make_spec(normalize=True, **options))
    # dtype's default depends on the device: the job records what its auto ran in, so spelled out as that it
    # is the same job; as another it is a change, and the message says what the default is here
    assert run_job(make_spec(dtype="float32", **options)).status == "already complete"
    with pytest.raises(
        JobMismatchError,
        match=r"model.dtype: was 'auto' \(the default: 'float32' here, on cpu\), now 'bfloat16'",
    ):
        run_job(make_spec(dtype="bfloat16", **options))


def test_a_resume_that_spells_out_what_the_model_or_inputs_settle_is_the_same_job(tiny_model_dir, tmp_path):
    """--dtype float32 where auto ran in float32, --max-model-len at the model's context, --repetition-penalty
    1 for a model whose generation config sets none, --prompt-column the column the job picked, --chat where
    the model has a chat template: each computes what the option left out computes, and was refused as a
    changed setting (spelled out at the start and left out on resume, too). Where it computes otherwise it
    stays a change, and says what the default is."""
    from batchjob.job import make_spec, run_job
    from batchjob.job.state import JobMismatchError

    data = _rows(tmp_path / "in.jsonl")
    spelled = dict(
        dtype="float32", max_model_len=1024, repetition_penalty=1.0, prompt_column="prompt", chat=True
    )
    for name, value in spelled.items():
        for first, then in (({}, {name: value}), ({name: value}, {})):
            out = str(tmp_path / f"out-{name}-{bool(first)}")
            options = dict(input=[str(data)], output=out, model=str(tiny_model_dir), max_new_tokens=2)
            assert run_job(make_spec(**options, **first)).status == "complete"
            assert run_job(make_spec(**options, **then)).status == "already complete", (name, first)
    options["output"] = str(tmp_path / "out-other")
    assert run_job(make_spec(**options)).status == "complete"
    for name, value, message in (
        (
            "max_model_len",
            512,
            "sampling.max_model_len: was None (the default: 1024 for this model), now 512",
        ),
        (
            "repetition_penalty",
            1.05,
            "sampling.repetition_penalty: was None (the default: 1.0 for this model), now 1.05",
        ),
        ("chat", False, "prompt.chat: was None (the default: True for this model), now False"),
    ):
        with pytest.raises(JobMismatchError, match=re.escape(message)):
            run_job(make_spec(**options, **{name: value}))
    # a model whose generation config sets a penalty: it is the default, and 1 (none) is a change
    model = shutil.copytree(tiny_model_dir, tmp_path / "penalised")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"repetition_penalty": 1.05}))
    options |= dict(output=str(tmp_path / "out-penalised"), model=str(model))
    assert run_job(make_spec(**options)).status == "complete"
    assert run_job(make_spec(**options, repetition_penalty=1.05)).status == "already complete"
    message = "sampling.repetition_penalty: was None (the default: 1.05 for this model), now 1.0"
    with pytest.raises(JobMismatchError, match=re.escape(message)):
        run_job(make_spec(**options, repetition_penalty=1.0))


def test_status_says_a_killed_run_left_rows_to_redo(tmp_path):
    from batchjob.job.shard import Shard
    from batchjob.job.status import JobStatus, WorkerStatus

    stats = {
        "rows": 20,
        "elapsed_s": 3.0,
        "live": {"updated": 0, "finished_uncommitted": 20, "in_engine": 40},
    }
    killed = WorkerStatus(Shard(), "stopped", rows_done=0, rows_total=400, stats=stats)
    text = "\n".join(JobStatus(tmp_path, [killed], 400).lines("out"))
    assert "rows: 0 of 400 input rows" in text and "last run: 20 rows" in text
    assert "the last run ended without committing 20 rows it had finished (killed or crashed" in text, text
    assert "`batchjob run` with the same command redoes them" in text
    clean = WorkerStatus(Shard(), "stopped", rows_done=20, rows_total=400, stats=stats | {"live": {}})
    assert "without committing" not in "\n".join(JobStatus(tmp_path, [clean], 400).lines("out"))


def test_inputs_that_changed_by_a_few_bytes_say_how_many():
    from batchjob.job.inputs import _from_to

    assert _from_to(140_300, 140_310) == "from 140300 to 140310 bytes"  # not "137.0 KiB to 137.0 KiB"
    assert _from_to(1024, 4096) == "from 1.0 KiB to 4.0 KiB"


def test_validate_estimate_on_a_complete_job_says_nothing_is_left(tiny_model_dir, tmp_path):
    data = _rows(tmp_path / "in.jsonl")
    common = (
        "--model",
        tiny_model_dir,
        "--input",
        data,
        "--output",
        tmp_path / "out",
        "--max-new-tokens",
        "2",
    )
    assert invoke("run", *common)[0] == 0
    code, text = invoke("validate", *common, "--estimate")
    assert code == 0 and "finds the job complete in" in text and "resumes" not in text, text
    assert "estimated time: 0 s (the job is complete: nothing is left to run)" in text, text


def test_estimate_table_is_left_out_when_the_steps_cannot_tell_settings_apart():
    from batchjob.job.estimate import Calibration, Estimate

    flat = Calibration("s", 64, 1.0, 1000, 1000, alpha=0.0, beta_prompt=1e-4, beta_out=1e-4)
    alternatives = [("--max-num-seqs 32", flat.with_settings("--max-num-seqs 32", 32, None))]
    text = "\n".join(Estimate(64, 64, [10] * 64, 0, 0, 1024, 64, 1000, flat, alternatives).lines())
    assert (
        "not estimated (the calibration's steps were too alike" in text and "--max-num-seqs 32  " not in text
    )


def test_the_estimate_counts_the_samples_the_kv_pool_holds_at_once():
    """A pool that holds fewer samples than --max-num-seqs bounds the batch: the estimate was 2.5-3.6x too
    fast (it took 64 seats where 4 fit), and its table showed --max-num-seqs changing what it cannot."""
    from batchjob.job.estimate import Calibration, Estimate

    c = Calibration("s", 64, 1.0, 2048, 2048, 0.01, 1e-5, 1e-5, max_num_seqs=64, budget=2048)
    c.pool_tokens = 192  # 3 samples of 32 prompt + 32 output tokens
    assert c.seats(300 * 32, 300 * 32, 300) == 3
    free = c.with_settings("free", None, None)
    free.pool_tokens = 0
    assert c.job_seconds(300 * 32, 300 * 32, 300) > 10 * free.job_seconds(300 * 32, 300 * 32, 300)
    more = [("--max-num-seqs 128", c.with_settings("--max-num-seqs 128", 128, None))]
    text = "\n".join(Estimate(300, 300, [32] * 300, 0, 0, 1024, 300, 300 * 32, c, more).lines())
    assert "the KV pool holds about 3 samples at once (of --max-num-seqs 64)" in text
    assert text.count(text.split("estimated time: ")[1].split("\n")[0]) == 2  # 128 seats: the same time


def test_a_template_typed_on_the_command_line_reads_its_escapes_as_a_job_file_does(tiny_model_dir, tmp_path):
    from batchjob.cli import _unescape

    assert _unescape(r"Q: {prompt}\nA:\t\\n \d") == "Q: {prompt}\nA:\t\\n \\d"  # other backslashes as typed
    data = _rows(tmp_path / "in.jsonl")
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{data}"\noutput = "{tmp_path / "out"}"\nmodel = "{tiny_model_dir}"\n')
    code, text = invoke("validate", job, "--template", r"Q: {prompt}\nA:")
    assert code == 0 and repr("Q: {prompt}\nA:") in text, text
    # --stop too: '\n' typed was a backslash and an n, where a job file's "\n" is a newline
    code, text = invoke("run", job, "--stop", r"\n", "--stop", "x", "--max-new-tokens", "2")
    assert code == 0, text
    saved = read_json(tmp_path / "out" / "_batchjob" / "job.json")["fingerprint"]["sampling"]["stop"]
    assert saved == ["\n", "x"]


def test_the_run_says_which_input_columns_it_renames(tiny_model_dir, tmp_path, capsys):
    from batchjob.job import make_spec, run_job

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"prompt": "a", "error": "x", "input_error": "y"}) + "\n")
    spec = make_spec(
        input=[str(data)], output=str(tmp_path / "out"), model=str(tiny_model_dir), max_new_tokens=1
    )
    assert run_job(spec).status == "complete"
    err = capsys.readouterr().err
    assert "input column 'error' is written as 'input_input_error' (it clashes with a result column)" in err
    assert "'input_error' is written" not in err  # kept: no result column has its name


def test_the_run_says_what_it_takes_of_the_models_generation_config(tiny_model_dir, tmp_path, capsys):
    """Its repetition penalty applies (as generate's), its sampling settings do not: each said once."""
    import shutil

    from transformers import GenerationConfig

    from batchjob.job import make_spec, run_job

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    ).save_pretrained(model)
    data = _rows(tmp_path / "in.jsonl")
    spec = make_spec(input=[str(data)], output=str(tmp_path / "out"), model=str(model), max_new_tokens=2)
    assert run_job(spec).status == "complete"
    err = capsys.readouterr().err
    assert "generation_config.json sets repetition_penalty 1.05: it applies to every row" in err
    assert (
        "generation_config.json samples (temperature 0.7, top_p 0.8, top_k 20); this job decodes greedily"
        in err
    )
    # the way to sample is --temperature: --top-p or --top-k alone are a greedy job's unused options
    assert "for labels (a --temperature above 0 samples)" in err and "--top-p" not in err
    given = make_spec(input=[str(data)], output=str(tmp_path / "o2"), model=str(model), max_new_tokens=2)
    given.repetition_penalty, given.temperature = 1.0, 0.0
    assert run_job(given).status == "complete"
    assert "generation_config.json" not in capsys.readouterr().err  # the job's own settings: nothing to say


def test_a_sampling_job_says_which_of_the_models_sampling_settings_it_does_not_take(
    tiny_model_dir, tmp_path, capsys
):
    """The line on the model's sampling settings was said only to a greedy job: one sampling at
    --temperature 0.7, or with a params column, dropped the model's top_p and top_k without a word."""
    from transformers import GenerationConfig

    from batchjob.job import make_spec, run_job

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20).save_pretrained(model)
    data = _rows(tmp_path / "in.jsonl")
    spec = make_spec(input=[str(data)], output=str(tmp_path / "a"), model=str(model), max_new_tokens=2)
    spec.temperature = 0.7
    assert run_job(spec).status == "complete"
    assert (
        "batchjob: the model's generation_config.json sets top_p 0.8, top_k 20, which this job does not "
        "take: this job samples at top_p 1, top_k 0 (off); give --top-p/--top-k to use them\n"
    ) in capsys.readouterr().err
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "params": {"temperature": 0.5}}) + "\n")
    spec = make_spec(input=[str(rows)], output=str(tmp_path / "b"), model=str(model), max_new_tokens=2)
    spec.params_column, spec.top_p = "params", 0.8
    assert run_job(spec).status == "complete"
    assert (
        "sets temperature 0.7, top_k 20, which this job does not take: this job's rows take temperature 0, "
        "top_k 0 (off) where a row's parameters leave them out; give --temperature/--top-k to use them"
    ) in capsys.readouterr().err
    spec = make_spec(input=[str(data)], output=str(tmp_path / "c"), model=str(model), max_new_tokens=2)
    spec.temperature, spec.top_p, spec.top_k = 0.7, 0.8, 20
    assert run_job(spec).status == "complete"
    assert "generation_config.json" not in capsys.readouterr().err  # the model's own settings: nothing to say


def test_a_job_says_it_does_not_take_the_models_max_new_tokens(tiny_model_dir, tmp_path, capsys):
    """A generation_config.json's max_new_tokens 6 was dropped without a word: the job wrote 128 tokens a
    row (--max-new-tokens's default), where generate writes 6. max_length, where it is the bound, too."""
    from transformers import GenerationConfig

    from batchjob.job import make_spec, run_job

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    GenerationConfig(max_new_tokens=6).save_pretrained(model)
    data = _rows(tmp_path / "in.jsonl", n=1)
    spec = make_spec(input=[str(data)], output=str(tmp_path / "a"), model=str(model))
    assert run_job(spec).status == "complete"
    assert (
        "batchjob: the model's generation_config.json sets max_new_tokens 6, which this job does not take: "
        "it generates at most 128 tokens a row (--max-new-tokens, its default); "
        "give --max-new-tokens 6 to use it\n"
    ) in capsys.readouterr().err
    spec = make_spec(input=[str(data)], output=str(tmp_path / "b"), model=str(model), max_new_tokens=6)
    assert run_job(spec).status == "complete"
    assert "max_new_tokens" not in capsys.readouterr().err  # the job takes the model's: nothing to say
    GenerationConfig(max_length=40).save_pretrained(model)
    spec = make_spec(input=[str(data)], output=str(tmp_path / "c"), model=str(model), max_new_tokens=3)
    assert run_job(spec).status == "complete"
    assert (
        "sets max_length 40 (prompt and answer), which this job does not take: it generates at most 3 tokens "
        "a row (--max-new-tokens); give --max-new-tokens to change it"
    ) in capsys.readouterr().err


def test_a_job_left_to_the_default_dtype_resumes_only_where_it_resolves_the_same(
    tiny_model_dir, tmp_path, monkeypatch
):
    """--dtype auto is float32 on the CPU and bf16 on a GPU: a job started on one and resumed on the other
    would mix rows of both dtypes (the record said 'auto' both times). What it ran in is kept and checked."""
    import torch

    from batchjob.engine import config
    from batchjob.job import make_spec, run_job
    from batchjob.job.prepare import prepare
    from batchjob.job.state import JobMismatchError

    data = _rows(tmp_path / "in.jsonl")
    spec = make_spec(
        input=[str(data)], output=str(tmp_path / "out"), model=str(tiny_model_dir), max_new_tokens=2
    )
    assert run_job(spec).status == "complete"
    prepare(spec)  # the same machine: the same job
    monkeypatch.setattr(config, "resolve_dtype", lambda dtype, device: torch.bfloat16)  # as on a GPU
    with pytest.raises(JobMismatchError, match="model.dtype: 'auto' ran in float32, is bfloat16 here"):
        prepare(spec)


def test_a_resumed_runs_token_count_leaves_out_the_tokens_it_restored(tiny_model_dir, tmp_path):
    """A row saved mid-answer resumes from its tokens: the resumed run did not generate them (its tok/s was
    nearly twice what it ran at, counting them)."""
    import pyarrow.dataset as ds

    from batchjob.io.atomic import read_json
    from batchjob.job import make_spec, run_job
    from tests.jobproc import sigterm_after_steps

    data, out = _rows(tmp_path / "in.jsonl", n=12), tmp_path / "out"
    spec = make_spec(
        input=[str(data)],
        output=str(out),
        model=str(tiny_model_dir),
        max_new_tokens=24,
        max_num_seqs=4,
        chat=False,
        checkpoint_interval=0.001,
        num_speculative_tokens=0,
    )

    def generated():
        parts = [str(p) for p in out.glob("*.parquet")]
        return (
            sum(ds.dataset(parts, format="parquet").to_table().column("num_generated_tokens").to_pylist())
            if parts
            else 0
        )

    with sigterm_after_steps(10):
        assert run_job(spec).status == "interrupted"
    restored = sum(len(r["output_ids"]) for r in read_json(out / "_batchjob" / "inflight.json")["requests"])
    before = generated()
    assert restored > 0
    assert run_job(spec).status == "complete"
    assert read_json(out / "_batchjob" / "stats.json")["generated_tokens"] == generated() - before - restored


def test_validate_estimate_with_no_usable_row_says_the_time_is_unknown(tiny_model_dir, tmp_path):
    """Every sampled row an error (a prompt longer than the context): nothing to time, not 'inf h'."""
    data = _rows(tmp_path / "in.jsonl")
    args = ("--model", tiny_model_dir, "--input", data, "--output", tmp_path / "out", "--max-model-len", "4")
    code, text = invoke("validate", *args, "--estimate")
    assert code == 0 and "estimated time: unknown (no usable row among the" in text and "inf" not in text, (
        text
    )


def test_no_chat_with_a_messages_column_is_refused_and_a_job_that_recorded_it_resumes(
    tiny_model_dir, tmp_path
):
    """A column of messages is always rendered by the chat template: --no-chat was let go on a text model (its
    rows went through the template all the same) and made every row of a VLM an error ("needs a processor
    with a chat template; this one has none"). run and validate refuse it before work, naming both, also
    where the input's 'messages' column chose the prompts; a job that recorded it resumes without it."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": w}]}) + "\n" for w in "ab"))
    out = tmp_path / "out"
    common = ("--model", tiny_model_dir, "--input", data, "--output", out, "--max-new-tokens", 2)
    for command in ("validate", "run"):
        for given, named in ((("--messages-column", "messages"), "--messages-column"), ((), "the input's")):
            code, text = invoke(command, *common, *given, "--no-chat")
            assert code == 2 and f"--no-chat with {named}" in text, text
            assert "'messages': a column of chat messages is always rendered by the model's chat" in text
    assert not out.exists()
    code, text = invoke("run", *common, "--messages-column", "messages")
    assert code == 0, text
    saved = read_json(out / "_batchjob" / "job.json")
    assert saved["fingerprint"]["prompt"]["chat"] is None
    saved["fingerprint"]["prompt"]["chat"] = False  # as a job started with --no-chat recorded it
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke("run", *common, "--messages-column", "messages")
    assert code == 0 and "already complete" in text, text
