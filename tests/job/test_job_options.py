"""The job's own options, declared once (``job/spec.py``, with ``job/options.py``): each is a ``JobSpec``
field, a job file key and a flag of ``batchjob run`` and ``validate``, whose help shows the declared default."""

from __future__ import annotations

import dataclasses
import re

import pytest

from batchjob.cli import main
from batchjob.errors import ConfigError
from batchjob.job.options import JobOption, shown
from batchjob.job.spec import JobSpec, declared, load_job_file

OWN = [(f, opt) for _, f, opt in declared() if isinstance(opt, JobOption)]
COMMAND_ONLY = {  # each command's own options, which are not a job's
    "run": {"job_file", "num_shards", "shard_index", "devices", "ray_address"},
    "validate": {"job_file", "num_shards", "shard_index", "estimate", "estimate_rows"},
}


def _sample(f: dataclasses.Field) -> str:
    """A TOML value of the field's type."""
    kind = str(f.type)
    if kind.startswith("list"):
        return '["a"]'
    return {"int": "3", "float": "1.5", "bool": "true"}.get(kind.split(" ")[0], '"x"')


def test_every_field_of_a_job_is_declared():
    own = {f.name for f in dataclasses.fields(JobSpec)} - {"engine"}  # the engine's options: one field
    assert len(OWN) > 30 and {f.name for f, _ in OWN} == own
    for f, opt in OWN:
        assert "default" not in opt.help, f"{f.name}: the help restates a default by hand"


@pytest.mark.parametrize("command", ["run", "validate"])
def test_each_option_is_one_flag_with_its_default_in_the_help(command):
    params = main.commands[command].params
    flags = [o for p in params for o in p.opts]
    assert {p.name for p in params} == {name for name, _, _ in declared()} | COMMAND_ONLY[command]
    by_name = {p.name: p for p in params}
    for f, opt in OWN:
        flag = "--" + f.name.replace("_", "-")
        assert flags.count(flag) == 1, (command, flag)
        param = by_name[f.name]
        assert param.opts == [flag] and param.default is None  # left out: the job file's, else the default
        default = opt.default_help
        if default is None and f.default not in (dataclasses.MISSING, None) and f.default is not False:
            default = shown(f.default)
        if default is not None:
            assert param.help.endswith(f"(default: {default})."), (f.name, param.help)
        else:
            assert "default" not in param.help, (f.name, param.help)
    helps = {f.name: by_name[f.name].help for f, _ in OWN}
    assert helps["max_new_tokens"] == "Tokens to generate per row at most (default: 128)."
    assert helps["checkpoint_interval"].endswith("(default: 30).")  # 30.0 shown as written
    assert helps["top_k"].endswith("(default: 0).")  # a default of 0 is shown, not taken for "none"
    assert helps["model"].endswith("(default: embedded SmolLM2-135M-Instruct).")
    assert by_name["chat"].secondary_opts == ["--no-chat"] and by_name["append"].is_flag
    # whatever a job file may turn on (even --append, --retry-errors) the command line can turn off
    bools = [f.name for f, _ in OWN if str(f.type).startswith("bool")]
    assert all(by_name[name].secondary_opts == [f"--no-{name.replace('_', '-')}"] for name in bools)


def test_each_option_is_one_job_file_key(tmp_path):
    for f, _ in OWN:
        for key in (f.name, f.name.replace("_", "-")):
            path = tmp_path / "job.toml"
            path.write_text(f"{key} = {_sample(f)}\n")
            assert set(load_job_file(path)) == {f.name}, key
        if "_" in f.name:
            path.write_text(f"{f.name} = {_sample(f)}\n{f.name.replace('_', '-')} = {_sample(f)}\n")
            with pytest.raises(ConfigError, match="are the same field; keep only one of them"):
                load_job_file(path)


@pytest.mark.parametrize(
    "given, message",
    [
        ({"lookahead": 0}, "lookahead must be >= 1 rows, got 0"),
        ({"checkpoint_interval": 0}, "checkpoint_interval must be > 0 seconds, got 0.0"),
        ({"checkpoint_interval": "inf"}, "checkpoint_interval must be a float, got 'inf'"),
        ({"max_errors": 0}, "max_errors must be >= 1, got 0"),
        ({"max_reasoning_tokens": 0}, "max_reasoning_tokens must be >= 1, got 0"),
        (
            {"admission": "lifo"},
            "admission must be one of fcfs, longest-first, shortest-first, static; got 'lifo'",
        ),
        ({"format": "csv"}, "format must be one of rows, openai; got 'csv'"),
        ({"n": "2"}, "n must be an int, got '2'"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),  # was "'int' object is not iterable"
        ({"input": 5}, "input must be a string or a list of strings, got 5"),
    ],
)
def test_the_declared_checks_keep_their_messages(given, message):
    with pytest.raises(ConfigError) as e:
        JobSpec(**given)
    assert str(e.value) == message


def test_a_home_folder_path_is_expanded_for_the_state_and_the_parts_alike(tmp_path, monkeypatch, tiny_model_dir):
    """'~/out' (quoted on the command line, or in a job file) went to the part writer expanded and to the
    state folder as is: a literal ./~ held the state, the parts failed to land. Now ~ is the home folder."""
    import json
    import os

    from batchjob.job import make_spec, run_job

    home = tmp_path / "home"
    home.mkdir()
    (home / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text('input = "~/a.jsonl"\noutput = "~/out"\nmax-new-tokens = 2\n')
    spec = make_spec(job, model=str(tiny_model_dir))
    assert spec.input == [str(home / "a.jsonl")] and spec.output == str(home / "out")
    assert run_job(spec).status == "complete"
    assert (home / "out" / "_batchjob" / "job.json").exists() and list((home / "out").glob("part-*.parquet"))
    assert not os.path.exists(tmp_path / "~")


def test_an_input_list_holding_a_number_is_a_type_error_not_a_missing_file():
    from batchjob.job import make_spec

    with pytest.raises(ConfigError, match=r"input must be a list of strings, got \['a.jsonl', 3\]"):
        make_spec(input=["a.jsonl", 3], output="o")


@pytest.mark.parametrize(
    "in_file, given, kept",
    [
        ('template = "Is {review} good?"', {"prompt_column": "review"}, "prompt_column"),
        ('prompt-column = "review"', {"messages_column": "chat"}, "messages_column"),
        ('choices = ["yes", "no"]', {"json_schema": "schema.json"}, "json_schema"),
        ('json-schema = "schema.json"', {"regex": "[a-z]+"}, "regex"),
    ],
)
def test_the_command_line_replaces_the_job_files_member_of_an_exclusive_group(tmp_path, in_file, given, kept):
    """`batchjob run jobs/quickstart.toml --prompt-column review` was refused ("give only one of
    --prompt-column, --messages-column, --template; got ['prompt_column', 'template']": the template was the
    file's), though the command line overrides any field of a job file; the same for --json-schema over a
    file's choices."""
    from batchjob.job.spec import make_spec

    path = tmp_path / "job.toml"
    path.write_text(f'input = "in.jsonl"\noutput = "out"\nmodel = "m"\n{in_file}\n')
    (tmp_path / "schema.json").write_text('{"type": "integer"}')
    if "json_schema" in given:
        given = {"json_schema": str(tmp_path / "schema.json")}
    spec = make_spec(path, **given)
    groups = ("prompt_column messages_column template", "choices json_schema regex")
    group = next(g for g in groups if kept in g).split()
    assert [n for n in group if getattr(spec, n) is not None] == [kept]


def test_two_members_of_an_exclusive_group_at_one_level_are_refused_saying_where(tmp_path):
    from batchjob.job.spec import make_spec

    path = tmp_path / "job.toml"
    path.write_text(
        'input = "in.jsonl"\noutput = "out"\nmodel = "m"\ntemplate = "{a}"\nprompt-column = "a"\n'
    )
    both = f"--prompt-column and --template exclude each other; both were given in the job file {path}"
    with pytest.raises(ConfigError, match=re.escape(both)):
        make_spec(path)
    path.write_text('input = "in.jsonl"\noutput = "out"\nmodel = "m"\nchoices = ["x", "y"]\n')
    both = "--choices and --regex exclude each other; both were given on the command line"
    with pytest.raises(ConfigError, match=both):
        make_spec(path, choices=["x", "y"], regex="z")
