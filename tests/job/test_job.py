"""Job pieces: intervals, manifest, checksummed state, prompts, and a job over dirty Parquet."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchjob.errors import ConfigError, StateError
from batchjob.io.atomic import read_json, write_json
from batchjob.job import make_spec, run_job
from batchjob.job.intervals import IntervalSet
from batchjob.job.manifest import ErrorCounts, Manifest, PartRecord
from batchjob.job.prompts import PromptBuilder, plan_prompts
from batchjob.job.spec import JobSpec, load_job_file
from batchjob.job.templates import template_kwargs

pytestmark = pytest.mark.timeout(120)


def test_interval_set():
    s = IntervalSet()
    for x in [5, 3, 4, 10, 0, 1, 2, 11]:
        s.add(x)
    assert s.ranges() == [[0, 6], [10, 12]] and len(s) == 8
    assert 4 in s and 6 not in s and 11 in s and 12 not in s
    assert s.covers(1, 6) and not s.covers(5, 11)
    assert s.meets(5, 7) and s.meets(7, 11) and s.meets(11, 99) and not s.meets(6, 10) and not s.meets(12, 99)


def test_manifest_torn_tail_is_dropped_but_corruption_raises(tmp_path):
    m = Manifest(tmp_path / "m.jsonl")
    m.append(PartRecord("part-000000.parquet", 2, 0, 5, 6, [[0, 2]]))
    m.append(PartRecord("part-000001.parquet", 1, 1, 1, 0, [[2, 3]]))
    raw = (tmp_path / "m.jsonl").read_bytes()
    (tmp_path / "m.jsonl").write_bytes(raw[:-10])  # a crash mid-append
    m2 = Manifest(tmp_path / "m.jsonl")
    assert m2.names == {"part-000000.parquet"} and m2.done.ranges() == [[0, 2]]
    lines = raw.split(b"\n")
    (tmp_path / "m.jsonl").write_bytes(lines[0].replace(b'"rows":2', b'"rows":3') + b"\n" + lines[1] + b"\n")
    with pytest.raises(StateError, match="line 1 is corrupt"):
        Manifest(tmp_path / "m.jsonl")


def test_other_workers_errors_are_read_again_as_their_manifests_grow(tmp_path, monkeypatch):
    """A job-wide --max-errors looks at the other workers' manifests at each checkpoint: one that changed is
    read again (a part appended, a torn line being written), one that did not costs only a stat."""
    a, b = Manifest(tmp_path / "a.jsonl"), tmp_path / "b.jsonl"  # b: a worker that has committed nothing
    counts = ErrorCounts([a.path, b])
    assert counts.total() == 0
    a.append(PartRecord("part-000000.parquet", 4, 2, 5, 6, [[0, 4]]))
    assert counts.total() == 2
    Manifest(b).append(PartRecord("part-000001.parquet", 3, 1, 5, 6, [[4, 7]]))
    with open(b, "ab") as f:
        f.write(b'{"part": {"name": "part-0')  # being appended now: not committed yet
    assert counts.total() == 3
    reads = []
    monkeypatch.setattr(Manifest, "_load", lambda self: reads.append(self.path))
    assert counts.total() == 3 and reads == []  # nothing changed: nothing read


def test_with_retry_errors_other_workers_count_from_their_fewest_errors(tmp_path):
    """A job run again with --retry-errors: each worker drops its failed rows as it starts, a moment after the
    others; the rows about to be redone must not count (the first worker would stop at once)."""
    a = Manifest(tmp_path / "a.jsonl")
    a.append(PartRecord("part-000000.parquet", 4, 3, 5, 6, [[0, 4]]))
    counts = ErrorCounts([a.path], retrying=True)
    assert counts.total() == 0  # 3 failed rows, not redone yet
    a.rewrite([PartRecord("part-000000.parquet", 1, 0, 5, 6, [[0, 1]])])  # the worker dropped them
    assert counts.total() == 0
    a.append(PartRecord("part-000001.parquet", 3, 2, 5, 6, [[1, 4]]))  # and failed 2 of them again
    assert counts.total() == 2
    assert ErrorCounts([a.path]).total() == 2


def test_checksummed_json(tmp_path):
    write_json(tmp_path / "s.json", {"a": 1})
    assert read_json(tmp_path / "s.json") == {"a": 1}
    (tmp_path / "s.json").write_text((tmp_path / "s.json").read_text().replace('"a": 1', '"a": 2'))
    with pytest.raises(StateError, match="checksum"):
        read_json(tmp_path / "s.json")
    (tmp_path / "s.json").write_text('{"checksum": "ab", "bo')
    with pytest.raises(StateError, match="torn"):
        read_json(tmp_path / "s.json")


def test_job_file_fields_and_paths(tmp_path):
    (tmp_path / "j.toml").write_text('input = ["a.jsonl", "/abs/b.jsonl"]\nmax-new-tokens = 7\nstop = "x"\n')
    fields = load_job_file(tmp_path / "j.toml")
    assert fields["input"] == [str(tmp_path / "a.jsonl"), "/abs/b.jsonl"] and fields["max_new_tokens"] == 7
    spec = make_spec(tmp_path / "j.toml", max_new_tokens=9)
    assert spec.max_new_tokens == 9 and spec.stop == ["x"]
    with pytest.raises(ConfigError, match="max_new_tokens must be an int"):
        JobSpec(max_new_tokens="7")


def test_a_job_files_adapters_are_found_next_to_it_in_either_form_and_known_by_content(tmp_path, monkeypatch):
    """lora = ["a=ad"] (the command line's form) took 'ad' from the working directory where [lora] took it
    from the job file's folder; '~/ad' was known by its name, not its files (a replaced adapter resumed)."""
    from batchjob.job.lora import lora_identity

    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    (tmp_path / "j.toml").write_text('lora = ["a=ad"]\n')
    monkeypatch.chdir(tmp_path.parent)
    assert load_job_file(tmp_path / "j.toml")["lora"] == [f"a={tmp_path / 'ad'}"]
    monkeypatch.setenv("HOME", str(tmp_path))
    by_home, by_path = lora_identity({"a": "~/ad"}), lora_identity({"a": str(tmp_path / "ad")})
    assert by_home == by_path and not by_home["a"].startswith("hub:")


def test_a_job_field_below_the_lora_table_header_is_refused_not_taken_for_an_adapter(tmp_path):
    """TOML puts every key after [lora] into the table: max-new-tokens = 3 became an adapter named
    'max-new-tokens' (refused later for another reason, or fetched from the hub); an adapter that is one keeps
    a job field's name."""
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "adapter_config.json").write_text("{}")
    for line in ("max-new-tokens = 3", 'system = "Be brief."', 'stop = ["\\n"]', 'id_column = "id"'):
        (tmp_path / "j.toml").write_text(f'input = "a.jsonl"\n[lora]\nchat = "chat"\n{line}\n')
        key = line.split(" ")[0]
        with pytest.raises(
            ConfigError, match=f"'{key}' is a job field: TOML puts every key after the .lora."
        ):
            load_job_file(tmp_path / "j.toml")
    for line in ('format = "org/format-lora"', 'regex = "chat"'):  # a hub id, a folder of an adapter
        (tmp_path / "j.toml").write_text(f"[lora]\n{line}\n")
        assert list(load_job_file(tmp_path / "j.toml")["lora"]) == [line.split(" ")[0]]


def test_a_job_file_starting_with_a_byte_order_mark_is_read(tmp_path):
    """A job file saved with a UTF-8 BOM was refused as not valid TOML (at line 1, column 1)."""
    (tmp_path / "j.toml").write_bytes('\ufeffinput = "a.jsonl"\nmax-new-tokens = 7\n'.encode())
    assert load_job_file(tmp_path / "j.toml")["max_new_tokens"] == 7


def test_job_file_refuses_one_field_given_twice(tmp_path):
    (tmp_path / "j.toml").write_text('input = "a.jsonl"\nmax_new_tokens = 7\nmax-new-tokens = 9\n')
    with pytest.raises(
        ConfigError, match="'max_new_tokens' and 'max-new-tokens' are the same field; keep only"
    ):
        load_job_file(tmp_path / "j.toml")


def test_job_file_relative_model_folder(tmp_path, monkeypatch):
    """A relative model is a folder next to the job file, else one in the working directory, else a hub id."""
    jobs, cwd = tmp_path / "jobs", tmp_path / "cwd"
    (jobs / "models" / "tiny").mkdir(parents=True)
    (cwd / "models" / "other").mkdir(parents=True)
    (cwd / "models" / "tiny").mkdir(parents=True)  # the job file's folder comes first
    monkeypatch.chdir(cwd)
    job = jobs / "j.toml"
    for model, want in [
        ("models/tiny", str(jobs / "models" / "tiny")),
        ("models/other", "models/other"),  # not next to the job file: resolved in the working directory
        ("org/name", "org/name"),  # no such folder anywhere: a hub id
        ("./models/missing", str(jobs / "models" / "missing")),  # ./ always means the job file's folder
        ("", ""),  # the default model, as --model '' is (it was the job file's own folder)
    ]:
        job.write_text(f'model = "{model}"\n')
        assert load_job_file(job)["model"] == want, model


def test_prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = JobSpec(messages_column="m", system="Be brief.")
    plan = plan_prompts(spec, ["m"], True)
    b = PromptBuilder(plan, tok, max_model_len=64)
    text, err = b.text({"m": [{"role": "user", "content": "hi"}]})
    assert err is None and text.startswith("<|im_start|>system\nBe brief.") and text.endswith("assistant\n")
    assert b.text({"m": '[{"role": "user", "content": "hi"}]'})[0] == text  # JSON text works too
    assert "messages[0].content must be text" in b.build({"m": [{"role": "user"}]})[1]
    # a key the prompt would be built without is the row's error, as in an OpenAI request; null is absent
    tool = {"role": "tool", "content": "4", "tool_call_id": "c1"}
    assert (
        "messages[1].tool_call_id is not supported"
        in b.build({"m": [{"role": "user", "content": "hi"}, tool]})[1]
    )
    assert b.text({"m": [{"role": "user", "content": "hi", "name": None}]}) == (text, None)
    # --system goes first unless the conversation has its own system message
    own = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "hi"}]
    assert "Be brief." not in b.text({"m": own})[0]
    assert "is null" in b.build({"m": None})[1]
    assert "does not fit" in b.build({"m": [{"role": "user", "content": "great " * 200}]})[1]
    # a continuation follows the render (generation above; the scored column): it keeps the assistant's header
    scored = make_spec(task="score", score_column="a", messages_column="m")
    then = PromptBuilder(plan_prompts(scored, ["m", "a"], True), tok, None)
    assert then.text({"m": [{"role": "user", "content": "hi"}]})[0].endswith("<|im_start|>assistant\n")
    whole = PromptBuilder(plan_prompts(make_spec(task="score", messages_column="m"), ["m"], True), tok, None)
    assert whole.text({"m": [{"role": "user", "content": "hi"}]})[0].endswith("hi<|im_end|>\n")
    plain = PromptBuilder(plan_prompts(JobSpec(chat=False), ["text"], True), tok, 64)
    assert plain.text({"text": "hello"}) == ("hello", None)
    assert "not text" in plain.build({"text": 5})[1] and "empty" in plain.build({"text": "  "})[1]
    assert "missing" in plain.build({"other": "x"})[1]
    with pytest.raises(ConfigError, match="no chat template"):
        plan_prompts(JobSpec(chat=True), ["text"], False)
    # template kwargs where no prompt goes through the template were taken without a word
    kwargs = '{"enable_thinking": false}'
    for spec, template in [(JobSpec(chat=False), True), (make_spec(task="embed"), True), (JobSpec(), False)]:
        spec.template_kwargs = template_kwargs(kwargs)
        with pytest.raises(ConfigError, match="--chat-template-kwargs go to the chat template"):
            plan_prompts(spec, ["text"], template)
    assert plan_prompts(make_spec(chat_template_kwargs=kwargs), ["text"], True).chat


def test_dirty_parquet_job_every_row_once(tmp_path, tiny_model_dir):
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(
        pa.table({"k": [1, 2, 3, 4], "prompt": ["good one", None, "", "great " * 2000]}), d / "a.parquet"
    )
    pq.write_table(pa.table({"k": [5], "prompt": ["fine"], "more": [1.5]}), d / "b.parquet")
    (d / "c.parquet").write_bytes(b"garbage")
    result = run_job(
        make_spec(
            input=[str(d)],
            output=str(tmp_path / "o"),
            model=str(tiny_model_dir),
            max_new_tokens=3,
            chat=False,
        )
    )
    assert result.status == "complete"
    rows = sorted(
        ds.dataset(tmp_path / "o", format="parquet").to_table().to_pylist(), key=lambda r: r["k"] or 99
    )
    assert [r["k"] for r in rows] == [1, 2, 3, 4, 5, None]
    assert rows[0]["error"] is None and rows[0]["num_generated_tokens"] >= 1
    assert "null" in rows[1]["error"] and "empty" in rows[2]["error"] and "context" in rows[3]["error"]
    assert rows[4]["error"] is None and "c.parquet" in rows[5]["error"]
    # a damaged state file is reported, never trusted
    job = tmp_path / "o" / "_batchjob" / "job.json"
    job.write_text(job.read_text()[:50])
    with pytest.raises(StateError, match="job.json"):
        run_job(
            make_spec(
                input=[str(d)],
                output=str(tmp_path / "o"),
                model=str(tiny_model_dir),
                max_new_tokens=3,
                chat=False,
            )
        )
    assert (
        json.loads((tmp_path / "o" / "_batchjob" / "stats.json").read_text())["body"]["job"]["rows_done"] == 6
    )


def test_the_engine_is_what_the_job_layer_names(tiny_model_dir):
    """The job layer knows an engine only as ``JobEngine`` (job/seam.py): ``Engine`` has each of its members,
    and its methods take the protocol's parameters, of the same kinds."""
    import inspect

    from batchjob import Engine
    from batchjob.job.seam import JobEngine

    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=16)
    members = {n for n in vars(JobEngine) if not n.startswith("_")} | set(JobEngine.__annotations__)
    assert {"add_request", "step", "snapshot", "stats", "config", "tokenizer"} <= members
    for name in members:
        assert hasattr(engine, name), name
        want = vars(JobEngine).get(name)
        if inspect.isfunction(want):
            have = inspect.signature(getattr(Engine, name)).parameters
            for p in inspect.signature(want).parameters.values():
                assert p.name in have and have[p.name].kind == p.kind, (name, p.name)
    assert engine.stats.as_dict()  # the loop writes it into stats.json
