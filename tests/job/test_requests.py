"""Per-row parameters (--params-column) and OpenAI Batch API request files (--format openai)."""

from __future__ import annotations

import json
import math
import re
import shutil

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchjob.cli import main
from batchjob.engine.sampler import sample
from batchjob.errors import ConfigError
from batchjob.job.requests import PARAM_NAMES, ROLES, params_from_column, parse_request
from batchjob.job.spec import make_spec
from batchjob.sampling import SamplingParams
from tests.jobproc import sigterm_after_steps

pytestmark = pytest.mark.timeout(300)

BASE = SamplingParams(max_new_tokens=8, temperature=0.0, seed=11)
TEMPERATURE_RULE = "temperature must be a finite number, 0 (greedy) or >= 0.001"


def invoke(*argv):
    result = CliRunner().invoke(main, [str(a) for a in argv])
    return result.exit_code, result.output


def results(out):
    return sorted(
        ds.dataset(out, format="parquet").to_table().to_pylist(),
        key=lambda r: str(r.get("rid") or r.get("custom_id")),
    )


# -- the row -> parameters functions ----------------------------------------------------------------------


def test_params_column_values():
    p, err = params_from_column('{"max_new_tokens": 3, "temperature": 0.7}', "p", BASE)
    assert err is None and (p.max_new_tokens, p.temperature, p.seed) == (3, 0.7, 11)
    p, err = params_from_column({"n": 2, "stop": "x", "temperature": 1}, "p", BASE)  # a struct column
    assert err is None and p.n == 2 and p.stop == ["x"] and p.max_new_tokens == 8
    p, err = params_from_column({"n": 2}, "p", BASE)  # greedy: n copies of one answer, refused as vLLM does
    assert p is None and "n=2 with temperature 0 (greedy) gives 2 identical answers" in err
    assert params_from_column(None, "p", BASE) == (BASE, None)
    for value, message in [
        ('{"temperature": "hot"}', f"params column 'p': {TEMPERATURE_RULE}, got 'hot'"),
        ('{"max_new_tokens": 2.5}', "max_new_tokens must be an integer >= 1, got 2.5"),
        ('{"temprature": 1}', "unknown sampling parameter 'temprature'"),
        ('{"temperature": -1}', f"{TEMPERATURE_RULE}, got -1"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "not JSON"),
        ('{"n": true}', "n must be an integer in [1, 10000], got True"),
    ]:
        p, err = params_from_column(value, "p", BASE)
        assert p is None and message in err, (value, err)


def chat(messages, **body):
    return {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": messages} | body,
    }


def test_openai_request_lines():
    user = [{"role": "user", "content": "hi"}]
    req, p, err = parse_request(chat(user, max_tokens=5, temperature=0.2, seed=3, n=2), BASE, None)
    assert (
        err is None
        and req == {"messages": user}
        and (p.max_new_tokens, p.temperature, p.seed, p.n) == (5, 0.2, 3, 2)
    )
    req, p, err = parse_request(
        chat(user, max_completion_tokens=4, logprobs=True, top_logprobs=3), BASE, None
    )
    assert p.max_new_tokens == 4 and p.logprobs == 3
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    _, p, err = parse_request(chat(user, response_format=fmt), BASE, None)
    assert err is None and json.loads(p.json_schema) == schema
    _, p, _ = parse_request(chat(user, response_format={"type": "json_object"}), BASE, None)
    assert json.loads(p.json_schema) == {"type": "object"}
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req, _, err = parse_request(chat(parts), BASE, None)
    assert req == {"messages": [{"role": "system", "content": "a\nb"}]}  # as vLLM joins text parts
    completion = {
        "custom_id": "y",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Once", "logprobs": 2},
    }
    req, p, err = parse_request(completion, BASE, None)
    assert req == {"prompt": "Once"} and p.logprobs == 2
    _, _, err = parse_request(chat(user, model="gpt-4o"), BASE, {"tiny"})
    assert "body.model 'gpt-4o' is not this job's model (tiny)" in err
    for line, message in [
        (chat(user, tools=[{"type": "function"}]), "body.tools is not supported"),
        (chat(user, frequency_penalty=0.5), "body.frequency_penalty is not supported by batchjob (only 0)"),
        (chat(user, temperature="warm"), "temperature must be a finite number"),
        (chat(user, top_logprobs=2), "body.top_logprobs needs body.logprobs: true"),
        (chat([{"role": "user", "content": [{"type": "image_url"}]}]), "content[0]: only text parts"),
        (chat([]), "body.messages must be a non-empty list"),
        (chat(user) | {"url": "/v1/embeddings"}, "url '/v1/embeddings' is not supported"),
        (chat(user) | {"method": "GET"}, "method 'GET' is not supported"),
        (chat(user, response_format={"type": "xml"}), "response_format.type 'xml' is not supported"),
        ({"custom_id": "z", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}, "lists of prompts"),
    ]:
        req, p, err = parse_request(line, BASE, None)
        assert req is None and message in err, (line, err)


def test_a_body_that_turns_a_job_option_off_gets_it_off():
    """What a body leaves out takes the job's options; what it turns off is off: response_format text under
    --json-schema (the answer was held to the job's schema), logprobs false under --logprobs."""
    user = [{"role": "user", "content": "hi"}]
    job = BASE.replace(json_schema={"type": "object"}, logprobs=2)
    _, p, err = parse_request(chat(user, response_format={"type": "text"}, logprobs=False), job, None)
    assert err is None and (p.json_schema, p.regex, p.choices, p.logprobs) == (None, None, None, None)
    _, p, err = parse_request(chat(user, response_format={"type": "text"}, stop=["\n"]), job, None)
    assert err is None and p.stop == ["\n"]  # a stop with the job's schema would be refused
    _, p, err = parse_request(chat(user), job, None)
    assert err is None and p.json_schema is not None and p.logprobs == 2  # left out: the job's


def test_openai_request_line_fields_and_roles():
    user = [{"role": "user", "content": "hi"}]
    for role in ("system", "developer", "user", "assistant", "tool"):
        _, _, err = parse_request(chat([{"role": role, "content": "x"}]), BASE, None)
        assert err is None, (role, err)
    for line, message in [
        (chat([{"role": "wizard", "content": "x"}]), "body.messages[0].role 'wizard' is not a role (system,"),
        (chat(user) | {"priority": 1}, "unknown request field 'priority' (an OpenAI Batch request line has"),
        (chat(user) | {"custom_id": 7}, "custom_id must be a non-empty string, got 7"),
        (chat(user) | {"custom_id": ""}, "custom_id must be a non-empty string"),
        (chat(user, model=["a"]), "body.model must be a string"),
    ]:
        req, p, err = parse_request(line, BASE, {"tiny"})
        assert req is None and p is None and message in err, (line, err)
    # a column only other rows have (JSONL rows differ) is null in this one: not this line's field
    assert parse_request(chat(user) | {"priority": None}, BASE, None)[2] is None


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_body_keys = st.sampled_from(
    [
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
        "model",
        "frequency_penalty",
        "stream",
        "logit_bias",
        "tools",
        "user",
    ]
)


@st.composite
def _request_lines(draw):
    """Request lines near the valid ones: a valid chat or completion line with random JSON in some fields
    (top-level, body and message fields), so the fuzz reaches every check, not just the first."""
    completions = draw(st.booleans())
    body = {"prompt": "Once"} if completions else {"messages": [{"role": "user", "content": "hi"}]}
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/completions" if completions else "/v1/chat/completions",
        "body": body,
    }
    for key in draw(st.lists(_body_keys, max_size=4)):
        body[key] = draw(_json)
    if not completions and draw(st.booleans()) and isinstance(body.get("messages"), list):
        message = {
            "role": draw(st.sampled_from(["user", "system", "wizard"]) | _json),
            "content": draw(_json),
        }
        body["messages"] = [*body["messages"], message]
    if draw(st.booleans()):  # a structured-output request with a random schema
        kind = draw(st.sampled_from(["json_schema", "json_object", "text"]) | _json)
        body["response_format"] = {"type": kind, "json_schema": {"name": "x", "schema": draw(_json)}}
    for key in draw(st.lists(st.sampled_from(["custom_id", "method", "url", "body", "extra"]), max_size=2)):
        line[key] = draw(_json)
    return line


@pytest.mark.engine  # 400 fuzzed lines take tens of seconds: not the unit tier's inner loop
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_request_lines())
def test_openai_request_parser_fuzz(line):
    """Random JSON values in every field of a request line: a request with parameters, or an error naming
    what is wrong; never an exception."""
    req, params, err = parse_request(line, BASE, {"tiny"})
    if req is None:
        assert params is None and isinstance(err, str) and err
    else:
        assert err is None and isinstance(params, SamplingParams)
        assert ("prompt" in req) != ("messages" in req)
        if "messages" in req:
            assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in req["messages"])


# -- jobs -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("params")
    rows = []
    for i in range(12):
        params = [{"max_new_tokens": 2}, {"max_new_tokens": 6, "temperature": 0.9}, None, {"n": 2}][i % 4]
        params = {"n": 2, "temperature": 0.8} if i % 4 == 3 else params  # n greedy copies are refused
        rows.append({"rid": f"r{i:02d}", "review": f"review {i} was fine", "p": json.dumps(params)})
    rows[5]["p"] = '{"temperature": "hot"}'
    with open(folder / "rows.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    struct = pa.table(
        {
            "rid": ["s0", "s1"],
            "review": ["a", "b"],
            "p": [
                {"max_new_tokens": 1, "n": None, "temperature": None},
                {"max_new_tokens": None, "n": 3, "temperature": 0.5},
            ],
        }
    )
    pq.write_table(struct, folder / "struct.parquet")
    return folder


def params_args(data, out, model, *extra):
    return [
        "run",
        "--input",
        data,
        "--output",
        out,
        "--model",
        model,
        "--template",
        "Review: {review}",
        "--id-column",
        "rid",
        "--params-column",
        "p",
        "--max-new-tokens",
        "4",
        "--seed",
        "3",
        *extra,
    ]


def test_params_column_job(params_data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(*params_args(params_data / "rows.jsonl", out, tiny_model_dir))
    assert code == 0, text
    got = results(out)
    bad = [r for r in got if r["error"]]
    assert len(bad) == 1 and bad[0]["rid"] == "r05"
    assert bad[0]["error"] == (f"rows.jsonl line 6: params column 'p': {TEMPERATURE_RULE}, got 'hot'")
    by_id: dict[str, list] = {}
    for r in got:
        by_id.setdefault(r["rid"], []).append(r)
    for i in range(12):
        if i == 5:
            continue
        rows = by_id[f"r{i:02d}"]
        limit = [2, 6, 4, 4][i % 4]  # a row's own max_new_tokens, else the job's
        assert len(rows) == (2 if i % 4 == 3 else 1)
        assert all(r["num_generated_tokens"] <= limit for r in rows)
        assert sorted(r["sample_index"] for r in rows) == list(range(len(rows)))
    # a struct column
    out2 = tmp_path / "out2"
    code, text = invoke(*params_args(params_data / "struct.parquet", out2, tiny_model_dir))
    assert code == 0, text
    got = results(out2)
    assert [r["rid"] for r in got] == ["s0", "s1", "s1", "s1"] and got[0]["num_generated_tokens"] <= 1


def test_retry_errors_keeps_a_parts_good_rows_with_per_row_params(params_data, tiny_model_dir, tmp_path):
    """One part writer per run: --retry-errors takes the failed row out of a part that has every per-row
    feature column and keeps the others (a writer built without those columns could not read the part back,
    and redid all its rows)."""
    out = tmp_path / "out"
    args = params_args(params_data / "rows.jsonl", out, tiny_model_dir)
    assert invoke(*args)[0] == 0
    before = sorted(results(out), key=lambda r: (r["rid"], r["sample_index"]))
    code, text = invoke(*args, "--retry-errors")
    assert code == 0, text
    assert "holds 1 rows with errors; they will be redone" in text and "cannot be read back" not in text
    assert "this run: 1 rows" in text  # only the failed row is computed again
    assert sorted(results(out), key=lambda r: (r["rid"], r["sample_index"])) == before


def test_params_column_job_resumes_exactly(params_data, tiny_model_dir, tmp_path, monkeypatch):
    want, out = tmp_path / "want", tmp_path / "out"
    assert invoke(*params_args(params_data / "rows.jsonl", want, tiny_model_dir))[0] == 0
    args = params_args(params_data / "rows.jsonl", out, tiny_model_dir, "--checkpoint-interval", "0.001")
    with sigterm_after_steps(5):
        code, text = invoke(*args)
    assert code == 75, text
    saved = json.loads((out / "_batchjob" / "inflight.json").read_text())["body"]["requests"]
    assert saved and all("params" in r for r in saved)  # each row's own parameters are checkpointed
    assert invoke(*args)[0] == 0

    def key(r):
        return (r["rid"], r["sample_index"])

    assert sorted(results(out), key=key) == sorted(results(want), key=key)


GREEDY_SAMPLES = "n=2 with temperature 0 (greedy) gives 2 identical answers: give a temperature above 0 for"
GREEDY_SAMPLES += " samples, or n 1"


def test_n_samples_at_the_jobs_temperature_0_are_left_to_the_rows(tiny_model_dir, tmp_path):
    """--n 2 at the job's temperature 0 was refused before work even where the params column gives rows a
    temperature: the rows decide, and a row left greedy (no temperature, no n 1) is that row's error."""
    data = tmp_path / "rows.jsonl"
    params = [{"temperature": 0.8}, None, {"max_new_tokens": 2}, {"n": 1}, {"temperature": 0.5, "n": 3}]
    rows = [
        {"rid": f"r{i}", "review": "fine", "p": json.dumps(p) if p else None} for i, p in enumerate(params)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = params_args(data, out, tiny_model_dir, "--n", "2")
    code, text = invoke("validate", *args[1:])
    assert code == 0, text
    code, text = invoke(*args)
    assert code == 0, text
    got: dict[str, list] = {}
    for r in results(out):
        got.setdefault(r["rid"], []).append(r)
    assert {k: len(v) for k, v in got.items()} == {"r0": 2, "r1": 1, "r2": 1, "r3": 1, "r4": 3}
    assert [r["error"] for r in got["r0"] + got["r3"] + got["r4"]] == [None] * 6
    for rid, line in (("r1", 2), ("r2", 3)):  # no params (null), and params without a temperature
        assert got[rid][0]["error"] == f"rows.jsonl line {line}: params column 'p': {GREEDY_SAMPLES}"
    # without a params column no row can give a temperature: refused before work, as before
    code, text = invoke(*args[:11], *args[13:])
    assert code == 2 and GREEDY_SAMPLES in text, text
    # a struct params column with neither a temperature nor an n field: no row gives its own either
    struct = tmp_path / "struct.parquet"
    pq.write_table(pa.table({"rid": ["s0"], "review": ["a"], "p": [{"max_new_tokens": 1}]}), struct)
    for command in ("validate", "run"):
        code, text = invoke(command, *params_args(struct, tmp_path / "o2", tiny_model_dir, "--n", "2")[1:])
        assert code == 2 and "a struct with neither a temperature nor an n field" in text, text
        assert GREEDY_SAMPLES in text and not (tmp_path / "o2").exists()


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("openai") / "requests.jsonl"
    lines = []
    for i in range(6):
        lines.append(
            {
                "custom_id": f"chat-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "gpt-4o-mini",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"Review {i}: fine"},
                    ],
                    "max_tokens": 5,
                    "temperature": 0,
                },
            }
        )
    lines.append(
        {
            "custom_id": "completion-0",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "gpt-4o-mini", "prompt": "Once upon", "max_tokens": 4, "temperature": 0},
        }
    )
    lines.append(
        {
            "custom_id": "sampled",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "n": 2, "max_completion_tokens": 3},
        }
    )
    lines.append(
        {
            "custom_id": "tools",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "tools": []},
        }
    )
    lines.append(
        {
            "custom_id": "logprobs",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        }
    )
    lines.append(
        {
            "custom_id": "completion-logprobs",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Once upon", "max_tokens": 3, "logprobs": 2, "temperature": 0},
        }
    )
    lines.append(
        {
            "custom_id": "wizard",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "wizard", "content": "x"}]},
        }
    )
    lines.append(
        {
            "custom_id": "extra-field",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}]},
            "priority": "high",
        }
    )
    with open(path, "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
        f.write('{"custom_id": "torn", "body": \n')
    return path


def test_openai_batch_file_runs_and_round_trips(requests_file, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(
        "run",
        "--input",
        requests_file,
        "--output",
        out,
        "--model",
        tiny_model_dir,
        "--format",
        "openai",
        "--max-new-tokens",
        "6",
    )
    assert code == 0, text
    assert "body.model ignored: the requests name 'gpt-4o-mini'" in text  # one warning, names listed
    table = ds.dataset(out, format="parquet").to_table().to_pylist()
    got = {(r["custom_id"], r["sample_index"]): r for r in table}
    assert ("sampled", 0) in got and ("sampled", 1) in got  # n=2
    assert "body.tools is not supported" in got[("tools", 0)]["error"]
    assert "requests.jsonl line 9: " in got[("tools", 0)]["error"]
    # a line's content is that line's error: an unknown role, a field OpenAI's request line does not have
    assert got[("wizard", 0)]["error"] == (
        "requests.jsonl line 12: body.messages[0].role 'wizard' is not a role "
        "(system, developer, user, assistant, tool)"
    )
    assert "line 13: unknown request field 'priority'" in got[("extra-field", 0)]["error"]
    assert {r["priority"] for r in table} == {None, "high"}  # kept as it was read, on the error row only
    assert [r["priority"] for r in table if r["priority"]] == ["high"]
    # --logprobs asked for in a request: one struct per generated token, the sampled one among its top 2
    lp = got[("logprobs", 0)]["logprobs"]
    assert len(lp) == got[("logprobs", 0)]["num_generated_tokens"] > 0
    for t in lp:
        assert len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 and isinstance(t["token"], str)
        assert t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"] >= -1e30
    assert got[("chat-0", 0)]["logprobs"] is None
    assert got[("completion-0", 0)]["num_generated_tokens"] <= 4
    # a greedy chat request answers what the same prompt through the chat template does
    plain = tmp_path / "plain.jsonl"
    with open(plain, "w") as f:
        for i in range(6):
            f.write(json.dumps({"rid": f"chat-{i}", "review": f"Review {i}: fine"}) + "\n")
    ref = tmp_path / "ref"
    code, text = invoke(
        "run",
        "--input",
        plain,
        "--output",
        ref,
        "--model",
        tiny_model_dir,
        "--template",
        "{review}",
        "--system",
        "Be brief.",
        "--id-column",
        "rid",
        "--max-new-tokens",
        "5",
    )
    assert code == 0, text
    for r in ds.dataset(ref, format="parquet").to_table().to_pylist():
        assert got[(r["rid"], 0)]["generated_text"] == r["generated_text"]
    # export: the OpenAI Batch output, one line per request, parsed with the openai package's types
    code, text = invoke("export", out, "--format", "openai", "--to", tmp_path / "results.jsonl")
    assert code == 0, text
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines][:7] == [f"chat-{i}" for i in range(6)] + ["completion-0"]
    by_id = {x["custom_id"]: x for x in lines}
    assert by_id["completion-0"]["response"]["body"]["object"] == "text_completion"
    assert len(by_id["sampled"]["response"]["body"]["choices"]) == 2
    assert by_id["tools"]["error"]["message"].endswith("body.tools is not supported by batchjob")
    # a bad request carries its HTTP status, as OpenAI and vLLM write it
    for bad in ("tools", "wizard", "extra-field"):
        response = by_id[bad]["response"]
        assert response["status_code"] == 400, bad
        assert response["body"]["error"]["type"] == "invalid_request_error"
        assert response["body"]["error"]["message"] == by_id[bad]["error"]["message"]
    assert all(x["response"]["status_code"] == 200 for x in lines if x["error"] is None)
    # logprobs asked for are exported in OpenAI's shape, the same numbers as the Parquet's
    content = by_id["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(t["token"], t["logprob"]) for t in lp]
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2 for c in content)
    text = by_id["completion-logprobs"]["response"]["body"]["choices"][0]
    assert "".join(text["logprobs"]["tokens"]) == text["text"]
    assert by_id["chat-0"]["response"]["body"]["choices"][0]["logprobs"] is None
    openai_types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    for x in lines:
        if x["error"] is None:
            body = x["response"]["body"]
            kind = openai_types.Completion if body["object"] == "text_completion" else ChatCompletion
            kind.model_validate(body)


def test_check_model_name(requests_file, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(
        "run",
        "--input",
        requests_file,
        "--output",
        out,
        "--model",
        tiny_model_dir,
        "--format",
        "openai",
        "--check-model-name",
    )
    assert code == 0 and "body.model ignored" not in text, text
    got = ds.dataset(out, format="parquet").to_table().to_pylist()
    wrong = [
        r for r in got if r["error"] and "body.model 'gpt-4o-mini' is not this job's model" in r["error"]
    ]
    assert len(wrong) == 7  # the six chat requests and the completion name gpt-4o-mini
    # whether it checks is the job's: a resume without the check is refused (its rows would mix both)
    code, text = invoke(
        "run", "--input", requests_file, "--output", out, "--model", tiny_model_dir, "--format", "openai"
    )
    assert code != 0 and "prompt.check_model_name" in text, text


def test_openai_text_parts_are_joined_with_a_newline_and_the_job_says_so(tiny_model_dir, tmp_path):
    """['Paris is', 'the capital'] was 'Paris isthe capital' (joined with nothing); vLLM joins text parts
    with a newline. An OpenAI job's identity lists openai-text-parts under prompt.rendering: one an earlier
    batchjob started is refused on resume, saying why."""
    from transformers import AutoTokenizer

    from batchjob.io.atomic import read_json, write_json

    parts = [{"type": "text", "text": "Paris is"}, {"type": "text", "text": "the capital"}]
    line = chat([{"role": "user", "content": parts}], max_tokens=2, temperature=0)
    data = tmp_path / "requests.jsonl"
    data.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out"
    args = ["run", "--input", data, "--output", out, "--model", tiny_model_dir, "--format", "openai"]
    code, text = invoke(*args)
    assert code == 0, text
    (row,) = ds.dataset(out, format="parquet").to_table().to_pylist()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conv = [{"role": "user", "content": "Paris is\nthe capital"}]
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert row["error"] is None and row["num_prompt_tokens"] == len(want["input_ids"])
    saved = read_json(out / "_batchjob" / "job.json")
    assert saved["fingerprint"]["prompt"]["rendering"] == ["messages-v2", "openai-text-parts"]
    del saved["fingerprint"]["prompt"]["rendering"]
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke(*args)
    assert code == 2 and "prompt.rendering: was None, now ['messages-v2', 'openai-text-parts']" in text, text
    assert "joined with a newline" in text and "another --output" in text


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"check_model_name": True}, "--check-model-name (it checks each request's body.model"),
        ({"image_workers": 0}, "--image-workers (a row's images: --image-column, or image parts in"),
        ({"max_image_pixels": 10, "allow_remote_images": True}, "--max-image-pixels, --allow-remote-images ("),
    ],
)
def test_an_option_the_job_has_no_use_for_is_refused(given, named):
    """They were taken without a word (and --check-model-name, --max-image-pixels were in the identity). A
    prompt column or a template says so at once; without either the input's columns decide (prepare)."""
    for prompts in ({"prompt_column": "text"}, {"template": "{text}"}):
        with pytest.raises(ConfigError, match=re.escape(f"this job has no use for {named}")):
            make_spec(input="x.jsonl", output="o", **prompts, **given)
    make_spec(input="x.jsonl", output="o", format="openai", **given)  # OpenAI requests' names and images
    if "check_model_name" not in given:  # a messages column's image parts
        make_spec(input="x.jsonl", output="o", messages_column="messages", **given)


def test_a_job_recorded_with_an_option_now_refused_as_unused_resumes_without_it(tiny_model_dir, tmp_path):
    """A rows job started with --check-model-name or --max-image-pixels (no use, now refused) could be
    resumed neither with them (refused) nor without (a different job): the record's entries are let go."""
    from batchjob.io.atomic import read_json, write_json

    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["run", "--input", data, "--output", tmp_path / "o", "--model", tiny_model_dir, "--max-new-tokens", "2"]
    assert invoke(*args)[0] == 0
    saved = read_json(tmp_path / "o" / "_batchjob" / "job.json")
    saved["fingerprint"]["prompt"] |= {"check_model_name": True, "max_image_pixels": 10}
    write_json(tmp_path / "o" / "_batchjob" / "job.json", saved)
    code, text = invoke(*args)
    assert code == 0 and "already complete" in text, text


def test_image_options_on_a_text_model_are_refused_and_a_job_that_recorded_one_resumes(
    requests_file, tiny_model_dir, tmp_path
):
    """--format openai on a text model: an image part is its request's error, so the image options have no
    use (--max-image-pixels was taken without a word, and recorded). run and validate refuse each before any
    work, naming it and the model; a job that recorded the bound resumes without it."""
    from batchjob.io.atomic import read_json, write_json

    out = tmp_path / "out"
    args = ["--input", requests_file, "--output", out, "--model", tiny_model_dir, "--format", "openai"]
    for command in ("validate", "run"):
        for option in (["--max-image-pixels", 1000], ["--allow-remote-images"], ["--image-workers", 1]):
            code, text = invoke(command, *args, *option)
            assert code == 2 and f"this job has no use for {option[0]}: model " in text, text
            assert "(llama) is not a vision-language model, so an image part in a request" in text, text
    assert not (out / "_batchjob" / "job.json").exists()
    assert invoke("run", *args)[0] == 0
    saved = read_json(out / "_batchjob" / "job.json")
    saved["fingerprint"]["prompt"] |= {"image_column": None, "max_image_pixels": 1000}  # as such a job did
    write_json(out / "_batchjob" / "job.json", saved)
    code, text = invoke("run", *args)
    assert code == 0 and "already complete" in text, text


DRAW_WHY = "a draw's: this job decodes greedily, at --temperature 0; give a --temperature above 0 to sample"


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"top_p": 0.9}, "--top-p"),
        ({"top_k": 20}, "--top-k"),
        ({"min_p": 0.05}, "--min-p"),
        ({"seed": 3, "temperature": 0.0}, "--seed"),
        ({"top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3}, "--top-p, --top-k, --min-p, --seed"),
    ],
)
def test_a_draws_options_where_every_row_is_greedy_are_refused(given, named, tiny_model_dir, tmp_path):
    """--top-p, --top-k, --min-p and --seed at the job's temperature 0 (the default) were taken without a
    word: 30 of 30 rows were greedy's. Refused by validate and run alike, naming --temperature; taken with a
    temperature above 0, and where rows may give their own (a params column, --format openai)."""
    them = "it" if "," not in named else "them"
    refusal = f"this job has no use for {named} ({DRAW_WHY}): leave {them} out"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        make_spec(input="x.jsonl", output="o", **given)
    make_spec(input="x.jsonl", output="o", **(given | {"temperature": 0.7}))
    make_spec(input="x.jsonl", output="o", params_column="p", **given)  # a row may give a temperature
    make_spec(input="x.jsonl", output="o", format="openai", **given)
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hello"}\n')
    flags = [a for k, v in given.items() for a in (f"--{k.replace('_', '-')}", v)]
    for command in ("validate", "run"):
        out = tmp_path / command
        code, text = invoke(command, "--input", data, "--output", out, "--model", tiny_model_dir, *flags)
        assert code == 2 and f"no use for {named}" in text and "Traceback" not in text, text
        assert not out.exists()


def test_a_draws_options_at_their_off_values_or_out_of_range_are_not_called_unused():
    make_spec(input="x.jsonl", output="o", top_p=1.0, top_k=0, min_p=0.0)  # what leaves them off
    with pytest.raises(ConfigError, match=re.escape("top_p must be a finite number in (0, 1], got 0")):
        make_spec(input="x.jsonl", output="o", top_p=0)
    with pytest.raises(ConfigError, match="no meaning for --task embed"):
        make_spec(input="x.jsonl", output="o", task="embed", top_p=0.5)


def test_a_job_recorded_with_a_draws_options_at_temperature_0_resumes_without_them(tiny_model_dir, tmp_path):
    """A greedy job started with --top-p or --seed (now refused: every row was greedy anyway) resumes without
    them; one that samples keeps them in its identity."""
    from batchjob.io.atomic import read_json, write_json

    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["run", "--input", data, "--output", tmp_path / "o", "--model", tiny_model_dir]
    args += ["--max-new-tokens", "2"]
    assert invoke(*args)[0] == 0
    saved = read_json(tmp_path / "o" / "_batchjob" / "job.json")
    saved["fingerprint"]["sampling"] |= {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3}
    write_json(tmp_path / "o" / "_batchjob" / "job.json", saved)
    code, text = invoke(*args)
    assert code == 0 and "already complete" in text, text
    code, text = invoke(*args, "--temperature", "0.5", "--seed", "4")
    assert code == 2 and "sampling.seed: was 3, now 4" in text, text


def test_a_params_column_row_with_a_draws_options_at_temperature_0_is_its_error():
    """A row's top_p, top_k, min_p or seed where its temperature is 0 (its own, or the job's it leaves to it),
    and the job's --top-p, --top-k, --min-p where the row leaves the job's temperature 0 to it, decoded
    greedily without a word. OpenAI bodies keep OpenAI's meaning (temperature 0 with top_p is accepted)."""
    greedy = "and this row decodes greedily at"
    cases = [
        ({"top_p": 0.9}, BASE, f"top_p 0.9 is an option of a draw, {greedy} the job's temperature 0"),
        (
            {"temperature": 0, "seed": 5, "top_k": 3},
            BASE,
            f"top_k 3, seed 5 are options of a draw, {greedy} its",
        ),
        ({}, BASE.replace(top_p=0.5), "the job's --top-p 0.5 is an option of a draw"),
        (None, BASE.replace(min_p=0.1), "the job's --min-p 0.1 is an option of a draw"),
    ]
    for value, base, message in cases:
        p, err = params_from_column(value if value is None else json.dumps(value), "p", base)
        assert p is None and err.startswith(f"params column 'p': {message}"), (value, err)
        assert "give the row a temperature above 0 to sample" in err
    for value, base in [
        ({"temperature": 0.5, "top_p": 0.9, "seed": 5}, BASE),
        ({"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}, BASE),  # the values that leave them off
        ({"temperature": 0}, BASE.replace(top_p=0.5)),  # the row asks for greedy: the job's top-p is not its
        ({"temperature": 0.7}, BASE.replace(top_p=0.5)),
    ]:
        p, err = params_from_column(json.dumps(value), "p", base)
        assert err is None, (value, err)
    body = chat([{"role": "user", "content": "hi"}], temperature=0, top_p=0.5)
    _, p, err = parse_request(body, BASE, None)
    assert err is None and p.greedy and p.top_p == 0.5


def test_duplicate_custom_id_refuses_the_file(requests_file, tiny_model_dir, tmp_path):
    """OpenAI's Batch API rejects a file with a custom_id used twice: so does `run` (and `validate`), before any
    work, naming both lines; nothing is written."""
    dup = tmp_path / "dup.jsonl"
    lines = requests_file.read_text().splitlines()
    dup.write_text("\n".join([*lines[:3], lines[1], *lines[3:]]) + "\n")
    for command in ("run", "validate"):
        out = tmp_path / f"out-{command}"
        code, text = invoke(
            command, "--input", dup, "--output", out, "--model", tiny_model_dir, "--format", "openai"
        )
        assert code == 2, text
        assert "dup.jsonl line 4: custom_id 'chat-1' is already used by dup.jsonl line 2" in text
        assert "give each request its own" in text and "Traceback" not in text
        assert not out.exists()


def test_openai_format_usage_errors(requests_file, tiny_model_dir, tmp_path):
    for extra, message in [
        (["--template", "{x}"], "--format openai takes the prompt and parameters from each request's body"),
        (["--id-column", "rid"], "the row id is each request's custom_id"),
        (["--no-chat"], "leave out --chat/--no-chat"),  # was ignored: chat requests went through the template
    ]:
        code, text = invoke(
            "run",
            "--input",
            requests_file,
            "--output",
            tmp_path / "o",
            "--model",
            tiny_model_dir,
            "--format",
            "openai",
            *extra,
        )
        assert code == 2 and message in text, text
    # --system was dropped from a completions request without a word (a chat request takes it)
    args = ["--input", requests_file, "--model", tiny_model_dir, "--format", "openai", "--max-new-tokens", "2"]
    code, text = invoke("run", *args, "--output", tmp_path / "system", "--system", "Be brief.")
    assert code == 0, text
    got = {r["custom_id"]: r for r in ds.dataset(tmp_path / "system", format="parquet").to_table().to_pylist()}
    assert "--system is a system message, which a completions request" in got["completion-0"]["error"]
    assert got["chat-0"]["error"] is None


def test_estimate_counts_each_requests_samples_and_tokens(tiny_model_dir, tmp_path):
    """`validate --estimate` on OpenAI requests with `n: 10000` (the most a row may ask): the time counts every sample of every
    request (and its max_tokens), not one answer a row; the calibration runs a batch of each row's samples."""
    from batchjob.job import make_spec
    from batchjob.job.estimate import estimate
    from batchjob.job.prepare import prepare

    def seconds(n: int, max_tokens: int):
        path = tmp_path / f"n{n}-{max_tokens}.jsonl"
        with open(path, "w") as f:
            for i in range(8):
                body = {"messages": [{"role": "user", "content": f"q {i}"}], "n": n, "max_tokens": max_tokens}
                line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                f.write(json.dumps(line) + "\n")
        spec = make_spec(
            input=[str(path)], output=str(tmp_path / f"out-{n}"), model=str(tiny_model_dir), format="openai"
        )
        est = estimate(prepare(spec), seconds=3.0)
        return est.seconds(est.calibration), est.lines(), est

    one, _, _ = seconds(1, 4)
    many, lines, est_many = seconds(10_000, 4)
    _, _, est_longer = seconds(10_000, 8)
    # at the same step costs (two calibrations differ by the machine's noise): only the tokens counted differ
    longer = est_longer.seconds(est_many.calibration)
    # 10,000 answers a request, not one (each costs less than a lone answer: a row's samples decode together)
    assert one > 0 and many > 100 * one, (one, many)
    assert longer > 1.5 * many  # twice the tokens each
    assert any("10,000.0 samples a usable row (80,000 in the first 8)" in line for line in lines), lines


# -- one numeric check, whatever the source (issue 22) -------------------------------------------------------

BAD_NUMBERS = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", 10**400),  # an int no float can hold
    ("temperature", 1e-300),  # logits / temperature would overflow: not 0 (greedy), not a usable temperature
    ("top_p", math.nan),
    ("top_p", -math.inf),
    ("min_p", math.nan),
    ("top_k", 2.0),
    ("max_new_tokens", True),
    ("logprobs", 101),
    ("n", 0),
    ("n", 10**9),  # a billion samples of one row would flood the engine
    ("seed", -1),
]
OPENAI_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "n": "n",
    "seed": "seed",
}


@pytest.mark.parametrize("name, value", BAD_NUMBERS)
def test_one_numeric_check_for_every_source(name, value, tmp_path):
    rule = f"{name} must be "
    # a params-column row, as JSON text (NaN and Infinity are what json writes) and as a struct: the row's error
    for cell in (json.dumps({name: value}), {name: value}):
        p, err = params_from_column(cell, "p", BASE)
        shown = repr(value) if value != 10**400 else "got an integer of 401 digits"
        assert p is None and err.startswith(f"params column 'p': {rule}") and shown in err, err
    # an OpenAI request body, under OpenAI's name for the field
    if name in OPENAI_NAMES:
        req, p, err = parse_request(
            chat([{"role": "user", "content": "hi"}], **{OPENAI_NAMES[name]: value}), BASE, None
        )
        field = OPENAI_NAMES[name]  # a name no body has was given (body: max_new_tokens must be ...)
        want = f"body.{field} must be " if field != name else f"body: {rule}"
        assert req is None and err.startswith(want), err
    # the library
    with pytest.raises(ConfigError, match=rule):
        SamplingParams(**{name: value})
    # the command line and the job file: a setup error before any work
    spec_value = value if name != "logprobs" else 101
    with pytest.raises(ConfigError, match=name):
        make_spec(input=["x.jsonl"], output="out", **{name: spec_value})
    if isinstance(value, float) and not math.isfinite(value):
        toml = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        job = tmp_path / "job.toml"
        job.write_text(f'input = "x.jsonl"\noutput = "out"\n{name.replace("_", "-")} = {toml}\n')
        with pytest.raises(ConfigError, match=name):
            make_spec(job)
        option = f"--{name.replace('_', '-')}"
        code, text = invoke("run", "--input", tmp_path / "x.jsonl", "--output", tmp_path / "o", option, toml)
        assert code == 2 and name in text and "Traceback" not in text, text


def test_good_numbers_still_pass():
    p, err = params_from_column(
        '{"temperature": 1, "top_p": 0.5, "top_k": 3, "min_p": 0, "seed": 0}', "p", BASE
    )
    assert err is None and (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 0.5, 3, 0, 0)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.001).temperature == 0.001


# -- seeds of any size (issue 22) ---------------------------------------------------------------------------


def test_seeds_of_any_size_map_into_range_by_the_documented_rule():
    assert SamplingParams(seed=5).seed == 5 and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # unchanged
    assert SamplingParams(seed=2**64 + 5).seed == 5
    assert SamplingParams(seed=2**200 + 7).seed == 7
    p, err = params_from_column(json.dumps({"seed": 2**70 + 3, "temperature": 1}), "p", BASE)
    assert err is None and p.seed == 3
    req, p, err = parse_request(chat([{"role": "user", "content": "hi"}], seed=2**80 + 1), BASE, None)
    assert err is None and p.seed == 1
    assert make_spec(input=["x.jsonl"], output="o", seed=2**64, temperature=1.0).sampling_params(0).seed == 0


def test_bad_values_and_big_seeds_in_a_job(tiny_model_dir, tmp_path):
    """NaN/Infinity are row errors, a seed of any size runs as its value mod 2**64, a row no parser can take
    is its own error: the job completes (exit 0) with every other row's text."""
    same = {"temperature": 0.9, "max_new_tokens": 5}
    rows = [{"rid": f"r{i}", "review": f"review {i} was fine", "p": json.dumps(same)} for i in range(3)]
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text("".join(json.dumps(r | {"p": json.dumps(same | {"seed": 5})}) + "\n" for r in rows))
    bad = [
        '{"temperature": NaN}',
        '{"top_p": Infinity}',
        '{"temperature": 1e999}',
        "[" * 100_000 + "]" * 100_000,  # the params text itself nested too deeply for the JSON parser
    ]
    with open(big, "w") as f:
        for r in rows:
            f.write(json.dumps(r | {"p": json.dumps(same | {"seed": 2**64 + 5})}) + "\n")
        for i, p in enumerate(bad):
            f.write(json.dumps({"rid": f"bad{i}", "review": "x", "p": p}) + "\n")
        f.write('{"rid": "deep", "review": ' + "[" * 200_000 + "]" * 200_000 + ', "p": null}\n')
    got = {}
    for data in (small, big):
        out = tmp_path / data.stem
        code, text = invoke(*params_args(data, out, tiny_model_dir))
        assert code == 0 and "Traceback" not in text, text
        got[data.stem] = {r["rid"] or r["error"]: r for r in results(out)}
    for i in range(3):
        assert got["big"][f"r{i}"]["generated_text"] == got["small"][f"r{i}"]["generated_text"]
        assert got["big"][f"r{i}"]["error"] is None
    errors = {k: r["error"] for k, r in got["big"].items() if r["error"]}
    assert errors["bad0"] == f"big.jsonl line 4: params column 'p': {TEMPERATURE_RULE}, got nan"
    assert (
        errors["bad1"]
        == "big.jsonl line 5: params column 'p': top_p must be a finite number in (0, 1], got inf"
    )
    assert errors["bad2"] == (  # no JSON number is infinite: the digits overflowed float64
        "big.jsonl line 6: params column 'p': the number 1e999 is past float64's range (it would be read as inf)"
    )
    assert errors["bad3"] == "big.jsonl line 7: params column 'p': not JSON (nested too deeply)"
    deep = [e for k, e in errors.items() if not k.startswith("bad")]
    assert deep == ["big.jsonl line 8: bad JSON (nested deeper than 100 levels)"]
    # --seed of any size: the same draws as its value mod 2**64
    texts = []
    for seed in (5, 2**64 + 5):
        out = tmp_path / f"seed{seed}"
        args = params_args(small, out, tiny_model_dir)
        args[args.index("--params-column") : args.index("--params-column") + 2] = []
        code, text = invoke(*args, "--temperature", "0.9", "--seed", seed)
        assert code == 0, text
        texts.append([r["generated_text"] for r in results(out)])
    assert texts[0] == texts[1]


# -- fuzz: any JSON in any field of a params-column row is a result or that row's error -------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**130), max_value=2**130)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted(PARAM_NAMES) + ["max_tokens", "", "temprature"]


@pytest.mark.engine  # 400 fuzzed rows take tens of seconds: not the unit tier's inner loop
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5), as_text=st.booleans())
def test_fuzz_params_column(row, as_text):
    value = json.dumps(row) if as_text else row  # JSON text, or the values a struct column gives
    params, error = params_from_column(value, "p", BASE)
    assert (params is None) != (error is None), (params, error)
    if error is not None:
        assert isinstance(error, str) and error.startswith("params column 'p': "), error
        return
    assert isinstance(params, SamplingParams)
    # what a checkpoint saves comes back the same, and the sampler takes it
    saved = json.loads(json.dumps(params.to_dict()))
    assert SamplingParams.from_dict(saved) == params
    if not params.constrained:
        logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
        (token,) = sample(logits, [params], [1], [0])
        assert 0 <= token < 50


def test_whatever_one_row_raises_is_that_rows_error(tiny_model_dir, tmp_path):
    """A chat template that raises on one row's text (any exception from any library, on one row): that
    row's error, naming the file and line; the job goes on and completes."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    template = "{% if 'boom' in messages[-1]['content'] %}{{ raise_exception('no boom here') }}{% endif %}"
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template + jinja.read_text())
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template + config["chat_template"]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["fine", "boom", "also fine"]))
    out = tmp_path / "out"
    code, text = invoke("run", "--input", data, "--output", out, "--model", folder, "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in text, text
    errors = [r["error"] for r in results(out) if r["error"]]
    assert len(errors) == 1 and errors[0].startswith("in.jsonl line 2: cannot build this row's request ("), (
        errors
    )
    assert "no boom here" in errors[0]


def test_chat_template_kwargs_that_are_apply_chat_templates_own_arguments_are_refused_before_work():
    """'{"add_generation_prompt": false}' passed validate, then every row was an error naming a TypeError."""
    for key in ("add_generation_prompt", "tokenize", "continue_final_message"):
        with pytest.raises(ConfigError, match=f"chat_template_kwargs: '{key}' is an argument batchjob gives"):
            make_spec(input=["x.jsonl"], output="o", chat_template_kwargs=json.dumps({key: True}))
    assert make_spec(
        input=["x.jsonl"], output="o", chat_template_kwargs='{"enable_thinking": false}'
    ).template_kwargs


def test_json_nested_too_deeply_in_any_option_or_field_is_an_error_not_a_crash(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    assert params_from_column(deep, "p", BASE) == (None, "params column 'p': not JSON (nested too deeply)")
    with pytest.raises(ConfigError, match=r"json_schema is not valid JSON \(nested too deeply\)"):
        SamplingParams(json_schema=deep)
    with pytest.raises(ConfigError, match=r"chat_template_kwargs must be a JSON object.*nested too deeply"):
        make_spec(input=["x.jsonl"], output="o", chat_template_kwargs=deep)
    schema = tmp_path / "schema.json"
    schema.write_text(deep)
    with pytest.raises(ConfigError, match="json_schema is not valid JSON"):
        make_spec(input=["x.jsonl"], output="o", json_schema=str(schema))


# -- values the tool can't honour exactly are refused, from every source ------------------------------------

CONSTRAINTS = {
    "choices": ({"choices": ["yes-sir", "no"]}, ["--choices", "yes-sir,no"]),  # a choice holds the stop
    "json_schema": ({"json_schema": {"type": "object"}}, ["--json-schema", "SCHEMA"]),
    "regex": ({"regex": "[a-z]+-[a-z]+"}, ["--regex", "[a-z]+-[a-z]+"]),
}


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_a_stop_with_a_constraint_is_refused_from_every_source(name, tmp_path):
    """A stop string (or token) can cut a constrained answer short: `{` under a schema, finish 'stop', no
    error; under choices one inside a choice was ignored. Neither is what was asked, so the pair is refused
    (a stop string no choice holds changes nothing, and stays allowed)."""
    constraint, flags = CONSTRAINTS[name]
    rule = f"stop and {name} exclude each other"
    with pytest.raises(ConfigError, match=rule):
        SamplingParams(stop=["-"], **constraint)
    with pytest.raises(ConfigError, match=f"stop_token_ids and {name} exclude each other"):
        SamplingParams(stop_token_ids=[5], **constraint)
    assert SamplingParams(stop=[], **constraint).stop == []  # an empty list stops nothing: fine
    if name == "choices":  # the quick start's: one-word labels and a stop at the line's end
        assert SamplingParams(stop=["\n"], choices=["yes", "no"]).stop == ["\n"]
    # a row: its stop with its constraint, or its stop under the job's constraint
    p, err = params_from_column(json.dumps({"stop": "-"} | constraint), "p", BASE)
    assert p is None and err.startswith(f"params column 'p': {rule}"), err
    p, err = params_from_column({"stop": ["-"]}, "p", SamplingParams(**constraint))
    assert p is None and rule in err, err
    # the command line and the job file: a setup error (exit 2) before any work
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    spec_value = str(schema) if name == "json_schema" else constraint[name]
    with pytest.raises(ConfigError, match=rule):
        make_spec(input=["x.jsonl"], output="o", stop=["-"], **{name: spec_value})
    flags = [str(schema) if f == "SCHEMA" else f for f in flags]
    code, text = invoke(
        "run", "--input", tmp_path / "x.jsonl", "--output", tmp_path / "o", "--stop", "-", *flags
    )
    assert code == 2 and rule in text and "Traceback" not in text, text


def test_a_stop_string_holding_the_replacement_character_is_refused_from_every_source(
    tiny_model_dir, tmp_path
):
    """The text shows U+FFFD while a character of several bytes is not yet whole, so a stop string holding it
    ended the row at the first byte of any such character: 'é€😀yz' was answered '', finish_reason 'stop'."""
    rule = "stop string '\ufffd' holds U+FFFD (the replacement character)"
    for stop in ("\ufffd", ["x", "a\ufffdb"]):
        with pytest.raises(ConfigError, match=re.escape("holds U+FFFD (the replacement character)")):
            SamplingParams(stop=stop)
    p, err = params_from_column(json.dumps({"stop": "\ufffd"}), "p", BASE)
    assert p is None and err.startswith(f"params column 'p': {rule}"), err
    _, p, err = parse_request(chat([{"role": "user", "content": "hi"}], stop=["\ufffd"]), BASE, None)
    assert p is None and err.startswith(f"body: {rule}"), err
    with pytest.raises(ConfigError, match=re.escape(rule)):
        make_spec(input=["x.jsonl"], output="o", stop=["\ufffd"])
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hello"}\n')
    for command in ("validate", "run"):
        out = tmp_path / command
        code, text = invoke(
            command, "--input", data, "--output", out, "--model", tiny_model_dir, "--stop", "\ufffd"
        )
        assert code == 2 and rule in text and "leave it out" in text and "Traceback" not in text, text
        assert not out.exists()
    assert SamplingParams(stop=["é", "😀"]).stop == ["é", "😀"]  # whole characters of several bytes: fine


def test_an_openai_body_with_stop_and_a_response_format_is_the_rows_error():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    user = [{"role": "user", "content": "hi"}]
    for body in (
        {"response_format": fmt, "stop": ['"']},
        {"response_format": {"type": "json_object"}, "stop": "}"},
    ):
        req, p, err = parse_request(chat(user, **body), BASE, None)
        assert req is None and err.startswith("body: stop and json_schema exclude each other"), err
    assert parse_request(chat(user, response_format={"type": "text"}, stop="x"), BASE, None)[2] is None


def test_the_library_refuses_a_wrong_type_a_row_would_be_refused_for():
    for bad, message in [
        ({"ignore_eos": "false"}, "ignore_eos must be true or false, got 'false'"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"stop": {"x": 1}}, "stop must be a string or a list of non-empty strings, got {'x': 1}"),
        ({"stop": {"x"}}, "stop must be a string or a list of non-empty strings, got {'x'}"),
        ({"choices": {"a": 1, "b": 2}}, "choices must be a non-empty list of non-empty strings, got {'a': 1"),
        ({"choices": {"a"}}, "choices must be a non-empty list of non-empty strings, got {'a'}"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            SamplingParams(**bad)
    assert SamplingParams(stop=("a", "b"), ignore_eos=True).stop == ["a", "b"]
    assert SamplingParams(choices=("a", "b")).choices == ["a", "b"]
    with pytest.raises(ConfigError, match="json_schema: key 'type' appears more than once"):
        SamplingParams(json_schema='{"type": "object", "type": "string"}')


def test_the_library_takes_numpy_numbers_as_their_python_values():
    import numpy as np

    p = SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.uint64(7))
    assert (p.max_new_tokens, p.temperature, p.seed) == (4, 0.5, 7) and type(p.max_new_tokens) is int
    for bad, message in [
        ({"max_new_tokens": np.float64(4.0)}, "max_new_tokens must be an integer >= 1, got 4.0"),
        ({"max_new_tokens": np.bool_(True)}, "max_new_tokens must be an integer >= 1, got True"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            SamplingParams(**bad)


def test_json_text_in_a_column_that_gives_a_key_twice_is_the_rows_error():
    text = '{"temperature": 0, "max_new_tokens": 2, "max_new_tokens": 9}'
    p, err = params_from_column(text, "p", BASE)
    assert p is None and err == (
        "params column 'p': key 'max_new_tokens' appears more than once in an object (which value is meant?)"
    ), err
    body = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "max_tokens": 12}'
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}
    req, p, err = parse_request(line, BASE, None)
    assert req is None and err.startswith("body: key 'max_tokens' appears more than once"), err


def test_openai_max_tokens_and_max_completion_tokens_that_differ_are_the_rows_error():
    user = [{"role": "user", "content": "hi"}]
    req, p, err = parse_request(chat(user, max_tokens=5, max_completion_tokens=7), BASE, None)
    assert req is None and err.startswith("body.max_tokens (5) and body.max_completion_tokens (7) differ"), (
        err
    )
    _, p, err = parse_request(chat(user, max_tokens=5, max_completion_tokens=5), BASE, None)
    assert err is None and p.max_new_tokens == 5


def test_openai_chat_logprobs_is_true_false_or_null():
    user = [{"role": "user", "content": "hi"}]
    for body, message in [
        ({"logprobs": 3}, "body.logprobs must be true or false, got 3"),
        ({"logprobs": "false"}, "body.logprobs must be true or false, got 'false'"),
        ({"logprobs": 1, "top_logprobs": 2}, "body.logprobs must be true or false, got 1"),
    ]:
        req, p, err = parse_request(chat(user, **body), BASE, None)
        assert req is None and message in err, (body, err)
    for flag, logprobs in [(False, None), (None, None), (True, 0)]:
        _, p, err = parse_request(chat(user, logprobs=flag), BASE, None)
        assert err is None and p.logprobs == logprobs, (flag, err)


def test_an_openai_bodys_token_limit_is_named_as_the_body_gives_it():
    """body.max_tokens 0 was reported as 'max_new_tokens must be ...', a name no body has."""
    user = [{"role": "user", "content": "hi"}]
    for name, value in (("max_tokens", 0), ("max_completion_tokens", 1.5)):
        _, _, err = parse_request(chat(user, **{name: value}), BASE, None)
        assert err is not None and err.startswith(f"body.{name} must be an integer >= 1, got"), err


@pytest.mark.parametrize("content", ["", " \n", [], [{"type": "text", "text": ""}]])
def test_an_openai_message_with_no_text_is_the_rows_error(content):
    """An empty message was answered, where an empty prompt column is an error row naming it."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    req, _, err = parse_request(chat(messages), BASE, None)
    assert req is None and err == "body.messages[1].content is empty (a user message with no text)", err
    req, _, err = parse_request(chat(messages), BASE, None, pictured=frozenset({1}))  # its images remain
    assert err is None and req is not None
    line = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": " \n"}}
    req, _, err = parse_request(line, BASE, None)
    assert req is None and err == "body.prompt is empty (only whitespace)", err


def test_an_openai_message_key_other_than_role_and_content_is_the_rows_error():
    user = [{"role": "user", "content": "hi"}]
    for message, key in [
        ({"role": "user", "content": "hi", "name": "ann"}, "name"),
        ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, "tool_calls"),
        ({"role": "tool", "content": "4", "tool_call_id": "1"}, "tool_call_id"),
        ({"role": "user", "content": "hi", "mood": "ok"}, "mood"),
    ]:
        req, _, err = parse_request(chat(user + [message]), BASE, None)
        assert req is None and err.startswith(f"body.messages[1].{key} is not supported by batchjob"), err
    # a key a Parquet struct gives every message, null in this one: not this message's field
    req, _, err = parse_request(chat([{"role": "user", "content": "hi", "name": None}]), BASE, None)
    assert err is None and req == {"messages": user}
