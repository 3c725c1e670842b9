"""Jobs with LoRA adapters: --lora / [lora], --adapter-column (null or empty: base; unknown: an error row),
one adapter for every row, --format openai's body.model, the adapter column, the adapters in the job's
identity, and a kill -9 then resume equal to an uninterrupted run."""

from __future__ import annotations

import io
import json
import random
import shutil
import signal
import time

import pytest

from batchjob.errors import ConfigError, InputError
from batchjob.job import make_spec, run_job
from batchjob.job.export import export
from tests.jobproc import read_results, run_here

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(600)

NAMES = ("qv", "mlp", "rs")
CONFIGS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "rs": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["o_proj"]),
}
N_ROWS = 60


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i + 1)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **CONFIGS[name]))
        model.save_pretrained(str(root / name))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    rng = random.Random(0)
    words = ["great", "terrible", "fine", "broke", "love", "quality", "price", "arrived", "slow", "cheap"]
    with open(path, "w") as f:
        for i in range(N_ROWS):
            adapter = [None, "", *NAMES][i % 5] if i != 7 else "nope"
            text = " ".join(rng.choices(words, k=rng.randint(3, 20)))
            f.write(json.dumps({"rid": f"r{i:03d}", "review": text, "adapter": adapter}) + "\n")
    return path


def _spec(rows, out, model, adapters, **extra):
    return (
        dict(
            input=[str(rows)],
            output=str(out),
            model=str(model),
            template="Review: {review}\nSentiment:",
            id_column="rid",
            max_new_tokens=8,
            max_num_seqs=8,
            lora=[f"{n}={p}" for n, p in adapters.items()],
        )
        | extra
    )


def test_adapter_column_one_adapter_and_identity(rows, tiny_model_dir, adapters, tmp_path):
    mixed = tmp_path / "mixed"
    assert run_job(make_spec(**_spec(rows, mixed, tiny_model_dir, adapters, adapter_column="adapter"))).status
    got = {r["rid"]: r for r in read_results(mixed)}
    assert len(got) == N_ROWS
    assert "unknown LoRA adapter 'nope'" in got["r007"]["error"]
    for rid, r in got.items():
        if rid != "r007":
            assert r["error"] is None
            assert r["adapter"] == [None, None, *NAMES][int(rid[1:]) % 5]
    assert got["r002"]["input_adapter"] == "qv"  # the input's own column keeps its values, renamed
    assert {r["adapter"] for r in got.values()} == {None, *NAMES}
    # One adapter and no column: every row takes it, and gets the text the mixed job gave its rows.
    alone = tmp_path / "alone"
    one = {"mlp": adapters["mlp"]}
    assert run_job(make_spec(**_spec(rows, alone, tiny_model_dir, one)))
    for r in read_results(alone):
        assert r["adapter"] == "mlp"
        if got[r["rid"]]["adapter"] == "mlp":
            assert r["generated_text"] == got[r["rid"]]["generated_text"]
    texts = {
        name: [r["generated_text"] for r in got.values() if r["adapter"] == name] for name in (None, *NAMES)
    }
    assert len({tuple(t[:1]) for t in texts.values()}) > 1
    # The job's identity holds each adapter by content: a changed adapter on resume is refused by name.
    changed = tmp_path / "changed"
    shutil.copytree(adapters["rs"], changed)
    cfg = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps(cfg | {"lora_alpha": 7}))
    spec = _spec(rows, alone, tiny_model_dir, {"mlp": changed})
    code, text = run_here(_args(spec))
    assert code != 0 and "lora.mlp" in text
    # Which row takes which adapter is the job's too: a column given on resume is refused by name (rows
    # finished, and rows saved mid-answer, under the one adapter would have mixed with the column's).
    code, text = run_here(_args(_spec(rows, alone, tiny_model_dir, one, adapter_column="adapter")))
    assert code != 0 and "prompt.adapter_column" in text, text


def _args(spec: dict) -> list[str]:
    out: list[str] = []
    for k, v in spec.items():
        for item in v if isinstance(v, list) else [v]:
            out += ["--" + k.replace("_", "-"), str(item)]
    return out


def test_refused_before_any_work(rows, tiny_model_dir, adapters, tmp_path):
    with pytest.raises(ConfigError, match="give --adapter-column"):
        make_spec(**_spec(rows, tmp_path / "o", tiny_model_dir, adapters))
    with pytest.raises(ConfigError, match="NAME=PATH"):
        make_spec(**_spec(rows, tmp_path / "o", tiny_model_dir, {}, lora=["justapath"]))
    with pytest.raises(ConfigError, match="--adapter-column needs adapters"):
        make_spec(**_spec(rows, tmp_path / "o", tiny_model_dir, {}, adapter_column="adapter"))
    # a misspelled column: every row would have run on the base model, without a word
    with pytest.raises(InputError, match="--adapter-column 'adaptr': the input has no such column"):
        run_job(make_spec(**_spec(rows, tmp_path / "o", tiny_model_dir, adapters, adapter_column="adaptr")))


def test_validate_refuses_what_the_engine_refuses_of_adapters(rows, tiny_model_dir, adapters, tmp_path):
    """validate said ok where run refused at load: an adapter that is no folder, a DoRA one, adapters under
    --compile, the input embedding or the output head as a target, modules_to_save but with --task classify
    (each before any weight is read now: the targets against the model built on the meta device)."""
    from click.testing import CliRunner

    from batchjob.cli import main

    def edited(name: str, **changes) -> object:
        folder = shutil.copytree(adapters["rs"], tmp_path / name)
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))
        return folder

    dora = edited("dora", use_dora=True)
    emb = edited("emb", target_modules=["embed_tokens", "o_proj"])
    head = edited("head", target_modules=["lm_head"])
    saved = edited("saved", modules_to_save=["score"])  # a classifier's head: only --task classify takes it
    for lora, extra, message in [
        (tmp_path / "missing", [], "is not a folder"),
        (dora, [], "DoRA (use_dora) is not supported"),
        (adapters["rs"], ["--compile"], "LoRA adapters with compile are not supported"),
        (emb, [], "the input embedding (model.embed_tokens) as a target is not supported"),
        (head, [], "the output head (lm_head) as a target is not supported"),
        (saved, ["--task", "score"], "modules_to_save is not supported here"),
        (saved, ["--task", "embed"], "modules_to_save is not supported here"),
    ]:
        spec = _spec(rows, tmp_path / "o", tiny_model_dir, {"a": lora})
        if "--task" in extra:
            del spec["max_new_tokens"]  # (generation's, refused with the other tasks)
        result = CliRunner().invoke(main, ["validate", *_args(spec), *extra])
        assert result.exit_code == 2 and message in result.output, result.output
    spec = _spec(rows, tmp_path / "o", tiny_model_dir, {"a": saved})
    del spec["max_new_tokens"]
    result = CliRunner().invoke(main, ["validate", *_args(spec), "--task", "classify"])  # its own head: taken
    assert result.exit_code == 0, result.output


def test_an_adapter_folder_rewritten_while_the_job_starts_is_refused(
    rows, tiny_model_dir, adapters, tmp_path, monkeypatch
):
    """The job identified the folder before the engine loaded it: a checkpoint saved into it between (as a
    training run saves one) had the job record the old files while the engine computed with the new ones. The
    job compares what the engine read with what it checked, and refuses the difference, naming the folder."""
    from batchjob.job import runner

    folder = shutil.copytree(adapters["qv"], tmp_path / "a")
    load = runner.load_engine

    def saved_while_loading(spec):  # the training run writes its next checkpoint as the engine starts
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(adapters["mlp"] / file, folder / file)
        return load(spec)

    monkeypatch.setattr(runner, "load_engine", saved_while_loading)
    spec = make_spec(**_spec(rows, tmp_path / "o", tiny_model_dir, {"a": folder}))
    with pytest.raises(
        ConfigError, match=f"LoRA adapter 'a': its folder {folder} changed while the job started"
    ):
        run_job(spec)
    assert not (tmp_path / "o" / "_batchjob" / "job.json").exists()
    monkeypatch.setattr(runner, "load_engine", load)  # nothing writes to it now: the job runs
    assert run_job(spec).status == "complete"


def test_job_file_lora_table_and_openai_body_model(tiny_model_dir, adapters, tmp_path):
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": m,
                "messages": [{"role": "user", "content": "Paris is the capital of"}],
                "max_tokens": 6,
                "temperature": 0,
            },
        }
        for i, m in enumerate(["qv", "rs", None, "some-other-model", "qv"])
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({k: v for k, v in x.items()}) + "\n" for x in lines))
    job = tmp_path / "job.toml"
    table = "".join(f'{n} = "{p}"\n' for n, p in adapters.items())
    job.write_text(
        f'input = "{requests}"\noutput = "{tmp_path / "out"}"\nmodel = "{tiny_model_dir}"\n'
        f'format = "openai"\n\n[lora]\n{table}'
    )
    assert run_job(make_spec(job)).status == "complete"
    got = {r["custom_id"]: r for r in read_results_by(tmp_path / "out", "custom_id")}
    assert [got[f"c{i}"]["adapter"] for i in range(5)] == ["qv", "rs", None, None, "qv"]
    assert got["c0"]["generated_text"] == got["c4"]["generated_text"]
    # the export answers each request as the model it ran on: its adapter's name, else the base model's
    text = io.StringIO()
    export(tmp_path / "out", "openai", text)
    models = {
        x["custom_id"]: x["response"]["body"]["model"] for x in map(json.loads, text.getvalue().splitlines())
    }
    base = models["c2"]
    assert base not in adapters and [models[f"c{i}"] for i in range(5)] == ["qv", "rs", base, base, "qv"]
    # an adapter known by the base model's name took the base's requests without a word
    with pytest.raises(ConfigError, match=f"--lora adapter '{base}' has a name of the base model"):
        make_spec(job, lora=[f"{base}={adapters['qv']}"])


def read_results_by(out, key):
    import pyarrow.dataset as ds

    return sorted(ds.dataset(out, format="parquet").to_table().to_pylist(), key=lambda r: r[key])


def test_sigkill_then_resume_equals_uninterrupted(launch, rows, tiny_model_dir, adapters, tmp_path):
    spec = _spec(rows, tmp_path / "ref", tiny_model_dir, adapters, adapter_column="adapter")
    assert run_job(make_spec(**spec)).status == "complete"
    expected = read_results(tmp_path / "ref")
    out = tmp_path / "out"
    args = _args(spec | {"output": str(out), "checkpoint_interval": 0.2})
    rng = random.Random(4)
    for _ in range(2):
        proc = launch(args, BATCHJOB_FAULT_PAUSE="part_committed")
        deadline = time.monotonic() + 120
        while not (out / "_batchjob" / "job.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(rng.uniform(0.3, 1.2))
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    code, output = run_here(args)
    assert code == 0, output
    assert read_results(out) == expected


@pytest.fixture(scope="module")
def mixed_expected(rows, tiny_model_dir, adapters, tmp_path_factory):
    """One worker's uninterrupted results of the mixed job (every adapter and the base model)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert run_job(make_spec(**_spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter"))).status
    return read_results(out)


@pytest.mark.process  # its launcher runs here, its workers are processes
def test_devices_with_adapters(rows, tiny_model_dir, adapters, tmp_path, mixed_expected, monkeypatch):
    """``--devices cpu,cpu``: each worker loads the same adapters; the combined results (the adapter column
    too) equal one worker's, status adds the adapters up over the workers, and a lost part is redone."""
    from click.testing import CliRunner

    from batchjob.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers inherit it
    out = tmp_path / "out"
    args = [
        "run",
        "--devices",
        "cpu,cpu",
        *_args(_spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter")),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "worker shard 1 of 2 on cpu: exit 0" in result.output
    assert read_results(out) == mixed_expected
    assert {p.name.split("-of-")[0] for p in out.glob("*.parquet")} == {"part-00000", "part-00001"}
    assert _status_adapters(out) == _counts(mixed_expected)
    next(iter(sorted(out.glob("part-00001*.parquet")))).unlink()  # a worker's part lost: rerun redoes it
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert read_results(out) == mixed_expected


def test_slurm_array_with_adapters_killed_and_resumed(
    launch, rows, tiny_model_dir, adapters, tmp_path, mixed_expected
):
    """Two Slurm array tasks with the adapters; one is killed (SIGKILL) after its first part, rerun, and
    the job's results equal one uninterrupted worker's."""
    from tests.faultproc import wait_for_points

    out = tmp_path / "out"
    args = _args(
        _spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter", checkpoint_interval=0.2)
    )

    def array_task(i, **extra):
        env = {"SLURM_ARRAY_TASK_ID": str(i), "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0"}
        return launch(args, SLURM_ARRAY_JOB_ID="9", OMP_NUM_THREADS="1", **env, **extra)

    victim = array_task(1, BATCHJOB_FAULT_PAUSE="part_committed")
    other = array_task(0)
    wait_for_points(victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    text = other.communicate(timeout=300)[0]
    assert other.returncode == 0, text
    rerun = array_task(1)
    text = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, text
    assert "shard 1 of 2 (from SLURM_ARRAY_TASK_ID" in text
    assert read_results(out) == mixed_expected
    assert _status_adapters(out) == _counts(mixed_expected)


def test_ray_worker_paths_absolute(rows, tiny_model_dir, adapters, tmp_path, monkeypatch):
    """A Ray task may start in another folder: the spec it gets names the adapters by absolute path, and the
    job's identity (the adapters by content) is the same."""
    from batchjob.job.launch import _absolute

    monkeypatch.chdir(adapters["qv"].parent)
    spec = make_spec(
        **_spec(
            rows,
            tmp_path / "o",
            tiny_model_dir,
            {"qv": "qv", "hub": "someone/adapter"},
            adapter_column="adapter",
        )
    )
    moved = _absolute(spec)
    assert moved.lora_paths == {"qv": str(adapters["qv"]), "hub": "someone/adapter"}
    from batchjob.job.lora import lora_identity

    assert lora_identity(moved.lora_paths) == lora_identity(spec.lora_paths)


@pytest.mark.ray
def test_ray_tasks_with_adapters(launch, rows, tiny_model_dir, adapters, tmp_path, mixed_expected):
    """``--ray --num-shards 2`` on a local instance: each task loads the adapters; the results equal one
    worker's, adapter column included."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    args = _args(_spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter"))
    proc = launch(["--ray", "--num-shards", "2", *args], RAY_ADDRESS="", OMP_NUM_THREADS="1")
    text = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, text
    assert "2 workers as Ray tasks" in text and "shard 1 of 2: complete" in text
    assert read_results(out) == mixed_expected


def test_refused_with_adapters_by_name(rows, tiny_model_dir, adapters, tmp_path):
    """Tensor parallelism with --lora: refused before any work, by name."""
    spec = _spec(rows, tmp_path / "o", tiny_model_dir, {"qv": adapters["qv"]})
    code, text = run_here([*_args(spec), "--tensor-parallel-size", "2", "--device", "cpu"])
    assert code == 2 and "LoRA adapters with tensor parallelism are not supported" in text, text
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.parquet"))


def test_report_per_adapter(rows, tiny_model_dir, adapters, tmp_path):
    """The report's adapters table: each adapter's rows, errors and generated tokens, as the results say."""
    import re

    from batchjob.job.report import build

    out = tmp_path / "job"
    assert run_job(make_spec(**_spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter"))).status
    want: dict[str, list[int]] = {}
    for r in read_results(out):
        counts = want.setdefault(_key(r), [0, 0, 0])
        counts[0] += 1
        counts[1] += r["error"] is not None
        counts[2] += r["num_generated_tokens"] or 0
    assert want[UNRUN] == [1, 1, 0]
    assert len(want) == 2 + len(NAMES) and all(c[2] > 0 for n, c in want.items() if "failed" not in n)
    page = build([out]).read_text()
    table = page[page.index('<table id="adapters">') :]
    table = table[: table.index("</table>")]
    got = {
        name: [int(n.replace(",", "")), int(e.replace(",", "")), int(g.replace(",", ""))]
        for name, n, e, _, g, rate in re.findall(
            r"<tr><td>([^<]+)</td><td>([\d,]+)</td><td>([\d,]+)</td><td>([\d,]+)</td><td>([\d,]+)</td><td>([\d.]+)</td></tr>",
            table,
        )
    }
    assert got == want


def _rates(page: str) -> dict[str, float]:
    """The report's adapters table: name -> its last run's tokens/s (the table's last column)."""
    import re

    table = page[page.index('<table id="adapters">') :]
    return {
        name: float(rate)
        for name, rate in re.findall(
            r"<tr><td>([^<]+)</td>(?:<td>[\d,]+</td>){4}<td>([\d.]+)</td></tr>", table
        )
    }


def test_report_rates_per_adapter_are_the_last_runs(rows, tiny_model_dir, adapters, tmp_path):
    """A last run (--append) of only one adapter's rows: the report gave the job's rate out by every adapter's
    share of all committed tokens (the repro: a 227.1 tok/s, b 75.7, where only b ran, at 302.7). Each
    adapter's rate is now its tokens in the last run; an older stats.json, without them, leaves the column
    out rather than guess."""
    from batchjob.io.atomic import read_json, write_json
    from batchjob.job.report import build

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(rows, folder / "a.jsonl")
    out = tmp_path / "job"
    spec = _spec(folder, out, tiny_model_dir, adapters, adapter_column="adapter")
    assert run_job(make_spec(**spec)).status == "complete"
    with open(folder / "z.jsonl", "w") as f:  # the next run's rows: adapter rs only
        for i in range(10):
            f.write(json.dumps({"rid": f"z{i}", "review": "great price " * (i + 1), "adapter": "rs"}) + "\n")
    assert run_job(make_spec(**spec, append=True)).status == "complete"
    rates = _rates(build([out]).read_text())
    assert rates == {"(base model)": 0.0, "qv": 0.0, "mlp": 0.0, "rs": rates["rs"], UNRUN: 0.0}, rates
    stats_file = out / "_batchjob" / "stats.json"
    stats = read_json(stats_file)
    assert stats["rows"] == 10 and set(stats["adapters"]) == {"rs"}
    assert rates["rs"] == round(stats["generated_tokens_per_s"], 1) > 0  # all the last run's tokens
    del stats["adapters"]  # as written before runs counted tokens by adapter
    write_json(stats_file, stats)
    page = build([out]).read_text()
    assert not _rates(page) and "rs</td><td>" in page  # the counts, without a rate
    assert "No generated tokens/s by adapter: the last run's stats.json does not count tokens" in page


def _status_adapters(out) -> dict[str, list[int]]:
    """``batchjob status``'s adapter lines: name -> [rows, errors, tokens out]."""
    import re

    from click.testing import CliRunner

    from batchjob.cli import main

    result = CliRunner().invoke(main, ["status", str(out)])
    assert result.exit_code in (0, 1), result.output
    lines = result.output.splitlines()
    start = lines.index("adapters:")
    got = {}
    for line in lines[start + 1 :]:
        m = re.fullmatch(r"  (\S.*?)\s+(\d+) rows, (\d+) errors, (\d+) tokens out", line)
        if m is None:
            break
        got[m[1]] = [int(m[2]), int(m[3]), int(m[4])]
    return got


UNRUN = "(no adapter: failed before it ran)"


def _key(r) -> str:
    """A result row's adapter as status names it: a row that failed before it ran (r007 names an adapter
    the job lacks) is not the base model's."""
    if r["adapter"] is None and r["error"] is not None and not r["num_prompt_tokens"]:
        return UNRUN
    return r["adapter"] or "(base model)"


def _counts(results) -> dict[str, list[int]]:
    want = {name: [0, 0, 0] for name in ("(base model)", *NAMES)}  # (and rows that never ran, if any)
    for r in results:
        counts = want.setdefault(_key(r), [0, 0, 0])
        counts[0] += 1
        counts[1] += r["error"] is not None
        counts[2] += r["num_generated_tokens"] or 0
    return want


def test_status_counts_an_adapters_input_rows_not_their_samples(rows, tiny_model_dir, adapters, tmp_path):
    """With --n 3 a row writes three result rows; status said '3 rows' of an adapter beside 'rows: 1 of 1'."""
    out = tmp_path / "job"
    spec = _spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter", n=3, temperature=1.0, seed=1)
    assert run_job(make_spec(**spec)).status == "complete"
    results = read_results(out)
    want = _counts(r for r in results if r["sample_index"] == 0)
    for name, c in want.items():  # tokens out: every sample's
        c[2] = sum(r["num_generated_tokens"] or 0 for r in results if _key(r) == name)
    assert sum(c[0] for c in want.values()) == N_ROWS and _status_adapters(out) == want


def test_status_per_adapter(rows, tiny_model_dir, adapters, tmp_path):
    """``batchjob status``: each adapter's committed rows, errors and generated tokens, as the results say;
    a deleted part's rows are not counted (under any adapter)."""
    import pyarrow.parquet as pq

    out = tmp_path / "job"
    spec = _spec(rows, out, tiny_model_dir, adapters, adapter_column="adapter", checkpoint_interval=0.05)
    assert run_job(make_spec(**spec)).status == "complete"
    want = _counts(read_results(out))
    assert all(c[0] > 0 for c in want.values()) and want[UNRUN] == [1, 1, 0]  # r007's unknown adapter
    assert _status_adapters(out) == want
    parts = sorted(p for p in out.glob("*.parquet"))
    gone, kept = parts[0], parts[1:]
    gone.unlink()
    left = [r for p in kept for r in pq.read_table(p).to_pylist()]
    assert _status_adapters(out) == _counts(left)
