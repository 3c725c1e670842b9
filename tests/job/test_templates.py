"""Templates are data, not code: only {column} fields (indexed into structs and lists), our own substitution.

A refused template is a setup error (exit 2 from run and validate, before any work); a row that does not fill
the template is an error row naming the column.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.errors import ConfigError
from batchjob.job.prompts import PromptBuilder, parse_template, plan_prompts, template_fields
from batchjob.job.spec import JobSpec, make_spec

pytestmark = pytest.mark.timeout(120)

REFUSED = [
    ("{review!x}", "{review!x}", "conversion"),
    ("{review!r}", "{review!r}", "conversion"),
    ("Hi {review.__class__.__mro__}", "{review.__class__.__mro__}", "attribute access"),
    ("{meta[title].upper}", "{meta[title].upper}", "attribute access"),
    ("{review:>10}", "{review:>10}", "format spec"),
    ("{review:{n}}", "{review:{n}}", "format spec"),
    ("{}", "{}", "positional"),
    ("{0}", "{0}", "positional"),
    ("{0[review]}", "{0[review]}", "positional"),
    ("{review[a]b}", "{review[a]b}", "not a column name"),
]


@pytest.mark.parametrize(("template", "field", "why"), REFUSED)
def test_refused_fields_name_the_template_the_field_and_what_is_allowed(template, field, why):
    with pytest.raises(ConfigError) as e:
        template_fields(template)
    msg = str(e.value)
    assert repr(template) in msg and f"field {field} is refused" in msg and why in msg
    assert "{review}" in msg and "{meta[title]}" in msg and "{tags[0]}" in msg  # what is allowed
    assert "{{ and }}" in msg  # how to write a literal brace
    with pytest.raises(ConfigError, match="refused"):  # the spec check every command runs first
        plan_prompts(JobSpec(template=template), ["review", "meta", "n"], False)


def test_unbalanced_braces_are_refused():
    for template in ("{review", "review}", "{review[}"):
        with pytest.raises(ConfigError, match="not a valid template.*literal braces"):
            template_fields(template)


def test_fields_and_literal_braces():
    assert template_fields("{a} {{not a field}} {b[x]} {a} {c[0][k]}") == ("a", "b", "c")
    assert template_fields("{meta[a.b]}") == ("meta",)  # a dot inside an index is a key, not an attribute
    assert template_fields("{my column}") == ("my column",)


def _text(template, values):
    plan = plan_prompts(JobSpec(template=template, chat=False), list(template_fields(template)), False)
    return PromptBuilder(plan, tokenizer=None, max_model_len=64).text(values)


def test_rendering_is_plain_substitution():
    values = {
        "review": "Great {n} {0.__class__} {{x}}",  # a value's braces are text, never formatted again
        "n": 3,
        "f": 1.5,
        "ok": True,
        "meta": {"title": "Über", "tags": ["a", "b"], "deep": {"k": None}},
        "tags": ["x", {"y": [1, "é"]}],
    }
    text, error = _text(
        "{{lit}} {review} | {n} {f} {ok} | {meta[title]} {meta[tags][1]} {tags[0]} | {tags[1]} | {meta}",
        values,
    )
    assert error is None
    assert text == (
        '{lit} Great {n} {0.__class__} {{x}} | 3 1.5 True | Über b x | {"y": [1, "é"]} | '
        '{"title": "Über", "tags": ["a", "b"], "deep": {"k": null}}'
    )


@pytest.mark.parametrize(
    ("template", "values", "error"),
    [
        ("{review}", {"other": "x"}, "column 'review' is missing in this row"),
        ("{review}", {"review": None}, "column 'review' is null"),
        ("{meta[title]}", {"meta": None}, "column 'meta' is null"),
        ("{meta[title]}", {"meta": {"other": 1}}, "{meta[title]}: 'meta' has no [title] in this row"),
        ("{meta[title]}", {"meta": {"title": None}}, "'meta[title]' is null"),
        ("{tags[2]}", {"tags": ["a", "b"]}, "{tags[2]}: 'tags' has no [2] in this row"),
        ("{tags[first]}", {"tags": ["a", "b"]}, "'tags' has no [first]"),
        ("{review[0]}", {"review": "text"}, "'review' has no [0]"),  # no indexing into strings
    ],
)
def test_a_row_that_does_not_fill_the_template_is_an_error_row(template, values, error):
    text, got = _text(template, values)
    assert text is None and error in got


def test_parse_keeps_text_and_fields_in_order():
    parts = parse_template("A {x[k]} B")
    assert parts[0] == "A " and parts[2] == " B"
    assert (parts[1].column, parts[1].path, parts[1].text) == ("x", ("k",), "{x[k]}")


@pytest.mark.parametrize(
    ("template", "values", "error"),
    [
        ("Say {b}", {"b": b"hello"}, "template field {b}: column 'b' is bytes, not text"),
        ("{s[x]}", {"s": {"x": b"hi"}}, "template field {s[x]}: 's[x]' is bytes, not text"),
        ("{s}", {"s": {"x": [b"hi"]}}, "template field {s}: 's[x][0]' is bytes, not text"),
        ("{tags}", {"tags": ["a", bytearray(b"b")]}, "template field {tags}: 'tags[1]' is bytes, not text"),
    ],
)
def test_bytes_are_an_error_row_never_their_repr(template, values, error):
    text, got = _text(template, values)
    assert text is None and error in got, got


def _typed_text(template, table):
    """Each row of ``table`` through the template, the plan knowing the columns' types (as a job's does)."""
    plan = plan_prompts(JobSpec(template=template, chat=False), table.schema.names, False, table.schema)
    builder = PromptBuilder(plan, tokenizer=None, max_model_len=64)
    return [builder.text(row) for row in table.to_pylist()]


MAPS = pa.table(
    {
        "n": pa.array(
            [[("title", "Dune")], [("title", "Emma"), ("year", "1815")]], pa.map_(pa.string(), pa.string())
        ),
        "m": pa.array([[(5, "five"), (0, "zero")], [(1, "one")]], pa.map_(pa.int64(), pa.string())),
        "s": pa.array(
            [{"meta": [("k", 1)]}, {"meta": [("k", 2), ("k", 3)]}],  # Arrow lets a map hold a key twice
            pa.struct([("meta", pa.map_(pa.string(), pa.int64()))]),
        ),
        "pairs": pa.array([[["k", "v"]], [["x", "y"]]], pa.list_(pa.list_(pa.string()))),  # not a map
    }
)


def test_a_map_is_looked_up_by_key_and_rendered_as_an_object():
    assert _typed_text("{n[title]} {m[0]} {m[5]}", MAPS)[0] == ("Dune zero five", None)
    assert _typed_text("{n} | {m} | {s}", MAPS)[0] == (
        '{"title": "Dune"} | {"5": "five", "0": "zero"} | {"meta": {"k": 1}}',
        None,
    )
    assert _typed_text("{n}", MAPS)[1] == ('{"title": "Emma", "year": "1815"}', None)
    # a list of pairs is a list, as it always was: indexed by position, rendered as a list
    assert _typed_text("{pairs[0][1]} {pairs}", MAPS)[0] == ('v [["k", "v"]]', None)


FLOATS = pa.table(
    {
        "f": pa.array([0.1, 1e20], pa.float32()),
        "h": pa.array([0.1, 65504.0], pa.float16()),
        "d": pa.array([0.1, 0.1 + 0.2], pa.float64()),
        "l": pa.array([[0.1, 2.5], []], pa.list_(pa.float32())),
        "s": pa.array(
            [{"x": 0.1, "t": "a"}, {"x": 0.3, "t": "b"}], pa.struct([("x", pa.float32()), ("t", pa.string())])
        ),
        "m": pa.array([[(0.1, 0.2)], []], pa.map_(pa.float32(), pa.float32())),
    }
)


def test_a_float32_or_float16_field_is_written_at_its_own_precision():
    """A float32 column's 0.1 was written as its float64 widening, 0.10000000149011612 (to_pylist widens it);
    Arrow's text and pandas show 0.1: the shortest text that reads back as the same float32 (float16)."""
    got = _typed_text("{f} {h} {d} | {l} {l[0]} | {s} {s[x]} | {m} {m[0.1]}", FLOATS)
    assert got[0] == ('0.1 0.1 0.1 | [0.1, 2.5] 0.1 | {"x": 0.1, "t": "a"} 0.1 | {"0.1": 0.2} 0.2', None)
    assert _typed_text("{f} {h} {d} {l} {m}", FLOATS)[1] == ("1e+20 65500.0 0.30000000000000004 [] {}", None)


def test_a_template_that_writes_a_float32_says_so_in_the_jobs_identity():
    from batchjob.job.templates import reads_narrow_float

    types = tuple((c, FLOATS.schema.field(c).type) for c in FLOATS.schema.names)
    assert all(reads_narrow_float(t, types) for t in ("{f}", "{h}", "{l[0]}", "{s}", "{s[x]}", "{m}"))
    assert not any(reads_narrow_float(t, types) for t in ("{d}", "{s[t]}", "no field"))


@pytest.mark.parametrize(
    ("template", "row", "error"),
    [
        ("{m[0]}", 1, "template field {m[0]}: 'm' has no [0] in this row"),
        ("{n[0]}", 0, "template field {n[0]}: 'n' has no [0] in this row"),  # a map is not a list
        ("{s[meta][k]}", 1, "template field {s[meta][k]}: 's[meta]' has the key [k] 2 times in this row"),
        ("{s}", 1, "template field {s}: 's[meta]' has the key [k] 2 times in this row"),
    ],
)
def test_a_map_without_the_key_or_with_it_twice_is_an_error_row(template, row, error):
    text, got = _typed_text(template, MAPS)[row]
    assert text is None and error in got, got


@pytest.mark.parametrize(
    ("template", "values", "error"),
    [
        ("{prompt}", {"prompt": ""}, "column 'prompt' is empty"),
        ("{prompt}", {"prompt": " \n\t"}, "column 'prompt' is empty"),
        (" {a}\n{b} ", {"a": "", "b": " "}, "columns 'a' and 'b' are empty"),
        ("{meta[title]}", {"meta": {"title": " "}}, "'meta[title]' is empty"),
    ],
)
def test_a_template_that_renders_empty_is_an_error_row(template, values, error):
    text, got = _text(template, values)
    assert text is None and error in got, got


def test_a_template_with_one_empty_field_among_text_is_not_empty():
    assert _text("Q: {a}", {"a": ""}) == ("Q: ", None)


@pytest.mark.parametrize("template", ["", "  ", "\n"])
def test_a_template_with_no_field_and_no_text_is_refused(template):
    with pytest.raises(ConfigError, match="no fields and no text"):
        plan_prompts(JobSpec(template=template), ["review"], False)


ONE_PROMPT = "every row's prompt would be this same text"


def test_a_template_with_no_field_is_refused_where_every_row_would_get_one_answer(tmp_path):
    """--template "Classify: review" (the braces forgotten) gave every row one prompt, and at temperature 0 one
    answer, without a word; sampled, or with something else that differs by row, one prompt is a use."""
    columns = ["review", "img", "params", "adapter"]
    with pytest.raises(ConfigError, match=f"{ONE_PROMPT}, with one identical answer.*columns: review, img"):
        plan_prompts(JobSpec(template="Classify: review"), columns, False)
    with pytest.raises(ConfigError, match=f"{ONE_PROMPT}, with one identical result"):
        plan_prompts(make_spec(template="Classify: review", task="embed"), columns, False)
    ad = tmp_path / "ad"
    for varies in [
        {"temperature": 0.7},  # synthetic data: many samples of one prompt
        {"image_column": "img"},
        {"params_column": "params"},
        {"adapter_column": "adapter", "lora": [f"a={ad}", f"b={ad}"]},
    ]:
        plan_prompts(make_spec(template="Describe it.", **varies), columns, False)


def test_a_template_that_is_a_files_path_is_refused_saying_how_to_pass_its_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "classify.txt").write_text("Classify: {review}\n")
    for temperature in (None, 0.7):  # sampled too: the file's name is never the prompt meant
        with pytest.raises(
            ConfigError, match=r"it is a file's path, and a template is text.*\$\(cat prompts/"
        ):
            plan_prompts(
                make_spec(template="prompts/classify.txt", temperature=temperature), ["review"], False
            )


# -- the command line ----------------------------------------------------------------------------------------


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {
                "review": ["great product", "bad", "fine"],
                "meta": [{"title": "T0"}, {"title": None}, {"title": "T2"}],
                "tags": [["a", "b"], ["c"], ["d", "e"]],
            }
        ),
        path,
    )
    return path


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize(("template", "field", "why"), REFUSED[:6])
@pytest.mark.parametrize("command", ["run", "validate"])
def test_refused_template_exits_2_before_any_work(
    command, template, field, why, data, tiny_model_dir, tmp_path
):
    out = tmp_path / "out"
    code, text = invoke(
        command, "--input", data, "--output", out, "--model", tiny_model_dir, "--template", template
    )
    assert code == 2, text
    assert f"field {field} is refused" in text and "Traceback" not in text
    assert not out.exists()  # refused before the output folder is even created


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_template_with_no_field_exits_2_before_any_work(command, data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--input", data, "--output", out, "--model", tiny_model_dir, "--template", "Classify: review"]
    code, text = invoke(command, *args)
    assert code == 2 and ONE_PROMPT in text and "Traceback" not in text, text
    assert not out.exists()


def test_struct_and_list_fields_in_a_job(data, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    template = "{review} / {meta[title]} / {tags[1]} / {tags}"
    out = tmp_path / "out"
    args = ["--input", data, "--output", out, "--model", tiny_model_dir, "--template", template]
    code, text = invoke("validate", *args)
    assert code == 0, text
    code, text = invoke("run", *args, "--no-chat", "--max-new-tokens", "2")
    assert code == 0, text
    rows = {r["review"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}
    assert "'meta[title]' is null" in rows["bad"]["error"]  # row 1: null title (and only one tag)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = "great product / T0 / b / " + json.dumps(["a", "b"])
    assert rows["great product"]["error"] is None
    assert rows["great product"]["num_prompt_tokens"] == len(tok(expected)["input_ids"])
    assert rows["fine"]["error"] is None


def test_map_fields_in_a_job(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    data = tmp_path / "maps.parquet"
    pq.write_table(MAPS, data)
    out = tmp_path / "out"
    template = "{n[title]} / {m[0]} / {n}"
    args = ["--input", data, "--output", out, "--model", tiny_model_dir, "--template", template]
    code, text = invoke("run", *args, "--no-chat", "--max-new-tokens", "2")
    assert code == 0, text
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert rows[0]["error"] is None
    assert rows[0]["num_prompt_tokens"] == len(tok('Dune / zero / {"title": "Dune"}')["input_ids"])
    assert "{m[0]}: 'm' has no [0] in this row" in rows[1]["error"]


def test_float32_fields_in_a_job_and_an_earlier_batchjobs_job_is_refused(tmp_path, tiny_model_dir):
    """A job writes a float32 column's 0.1 as 0.1 (its prompt was 'F: 0.10000000149011612'); its identity
    says so, and a job an earlier batchjob started (no such tag) is refused on resume, saying why."""
    from transformers import AutoTokenizer

    from batchjob.io.atomic import read_json, write_json

    data = tmp_path / "floats.parquet"
    pq.write_table(FLOATS, data)
    out = tmp_path / "out"
    args = ["--input", data, "--output", out, "--model", tiny_model_dir, "--template", "F: {f}"]
    code, text = invoke("run", *args, "--no-chat", "--max-new-tokens", "2")
    assert code == 0, text
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = [len(tok(t)["input_ids"]) for t in ("F: 0.1", "F: 1e+20")]
    assert [r["num_prompt_tokens"] for r in rows] == want
    saved = read_json(out / "_batchjob" / "job.json")
    assert saved["fingerprint"]["prompt"]["rendering"] == ["float32-fields"]
    del saved["fingerprint"]["prompt"]["rendering"]
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke("run", *args, "--no-chat", "--max-new-tokens", "2")
    assert code == 2 and "prompt.rendering: was None, now ['float32-fields']" in text, text
    assert "0.10000000149011612" in text and "another --output" in text
    code, text = invoke("run", *args[:3], tmp_path / "o2", *args[4:-1], "F: {d}", "--no-chat")  # float64
    assert code == 0, text
    assert "rendering" not in read_json(tmp_path / "o2" / "_batchjob" / "job.json")["fingerprint"]["prompt"]


# -- what the column types already say every row would fail: a setup error (issue 22) --------------------------


@pytest.fixture()
def typed_inputs(tmp_path):
    """A Parquet file with text, struct, list, integer and binary columns; a JSONL file with a text column and a
    column of nested lists (JSON text to the schema, lists in the rows)."""
    pq.write_table(
        pa.table(
            {
                "review": ["great", "bad"],
                "meta": [{"title": "T0"}, {"title": "T1"}],
                "tags": [["a"], ["b"]],
                "n": [1, 2],
                "p": [{"temprature": 0.5}, {"temprature": None}],
                "raw": pa.array([b"great", b"bad"], pa.binary()),
                "pm": pa.array([[("temperature", 0.5)], []], pa.map_(pa.string(), pa.float64())),
                "d": pa.array(["great", "bad"]).dictionary_encode(),
                "sv": pa.array(["great", "bad"], pa.string_view()),
                "bv": pa.array([b"great", b"bad"], pa.binary_view()),
            }
        ),
        tmp_path / "typed.parquet",
    )
    with open(tmp_path / "typed.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"row {i}", "nested": [[f"x{i}"]], "n": i}) + "\n")
    return tmp_path


TYPE_REFUSALS = [
    (
        "typed.parquet",
        ["--template", "{review[0]}"],
        "--template field {review[0]}: 'review' is text in the input",
    ),
    ("typed.jsonl", ["--template", "{text[0]}"], "--template field {text[0]}: 'text' is text in the input"),
    (
        "typed.parquet",
        ["--template", "{meta[titel]}"],
        "'meta' is a struct with the fields title; no row has [titel]",
    ),
    ("typed.parquet", ["--template", "{tags[x]}"], "'tags' is a list; index it with a number, not [x]"),
    (
        "typed.parquet",
        ["--template", "{meta[title][0]}"],
        "'meta[title]' is text in the input, so no row has [0]",
    ),
    ("typed.jsonl", ["--template", "{n[0]}"], "'n' is int64 in the input, so no row has [0]"),
    ("typed.parquet", ["--prompt-column", "n"], "prompt column 'n' is int64 in the input, not text"),
    ("typed.parquet", ["--prompt-column", "raw"], "prompt column 'raw' is binary in the input (bytes;"),
    ("typed.parquet", ["--prompt-column", "tags"], "prompt column 'tags' is list<element: string>"),
    ("typed.parquet", ["--prompt-column", "bv"], "prompt column 'bv' is binary_view in the input (bytes;"),
    ("typed.parquet", ["--template", "{d[0]}"], "--template field {d[0]}: 'd' is text in the input"),
    ("typed.parquet", ["--template", "{sv[0]}"], "--template field {sv[0]}: 'sv' is text in the input"),
    (
        "typed.jsonl",
        ["--template", "{text}", "--params-column", "n"],
        "--params-column 'n' is int64 in the input",
    ),
    (
        "typed.parquet",
        ["--template", "{review}", "--params-column", "pm"],
        "--params-column 'pm' is a map, whose values share one type, in the input",
    ),
    (
        "typed.parquet",
        ["--template", "{review}", "--params-column", "p"],
        "--params-column 'p': its struct has fields that are no sampling parameter: temprature",
    ),
]


@pytest.mark.parametrize(("data", "options", "message"), TYPE_REFUSALS)
def test_what_the_column_types_say_every_row_would_fail_is_refused_before_work(
    data, options, message, typed_inputs, tiny_model_dir, tmp_path
):
    out = tmp_path / "out"
    for command in ("validate", "run"):
        args = ["--input", typed_inputs / data, "--output", out, "--model", tiny_model_dir, *options]
        code, text = invoke(command, *args)
        assert code == 2 and message in text and "Traceback" not in text, text
        assert not out.exists()  # before any work


def test_types_that_allow_good_rows_are_left_to_the_rows(typed_inputs, tiny_model_dir, tmp_path):
    # JSONL nested values are text to the schema, lists in the rows; a text column with one list in it is
    # mixed: one bad row among good ones stays that row's error
    with open(typed_inputs / "mixed.jsonl", "w") as f:
        f.write(json.dumps({"text": ["first", "second"], "p": '{"n": 1}'}) + "\n")
        f.write(json.dumps({"text": "plain", "p": "{not json"}) + "\n")
    out = tmp_path / "out"
    args = ["--model", tiny_model_dir, "--no-chat", "--max-new-tokens", "1"]
    code, text = invoke(
        "run", "--input", typed_inputs / "typed.jsonl", "--output", out, *args, "--template", "{nested[0][0]}"
    )
    assert code == 0, text
    assert [r["error"] for r in ds.dataset(out, format="parquet").to_table().to_pylist()] == [None] * 3
    out = tmp_path / "mixed"
    code, text = invoke(
        "run",
        "--input",
        typed_inputs / "mixed.jsonl",
        "--output",
        out,
        *args,
        "--template",
        "{text[1]}",
        "--params-column",
        "p",
    )
    assert code == 0, text
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    assert rows[0]["error"] is None and "not JSON" in rows[1]["error"]
