"""Per-row parameters (--params-column) and OpenAI Batch API request files (--format openai)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchjob.cli import main
from batchjob.job.requests import ROLES, params_from_column, parse_request
from batchjob.sampling import SamplingParams
from tests.jobproc import sigterm_after_steps

pytestmark = pytest.mark.timeout(300)

BASE = SamplingParams(max_new_tokens=8, temperature=0.0, seed=11)


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
    p, err = params_from_column({"n": 2, "stop": "x"}, "p", BASE)  # a struct column
    assert err is None and p.n == 2 and p.stop == ["x"] and p.max_new_tokens == 8
    assert params_from_column(None, "p", BASE) == (BASE, None)
    for value, message in [
        ('{"temperature": "hot"}', "params column 'p': temperature must be a number, got 'hot'"),
        ('{"max_new_tokens": 2.5}', "max_new_tokens must be an int"),
        ('{"temprature": 1}', "unknown sampling parameter 'temprature'"),
        ('{"temperature": -1}', "temperature must be >= 0"),
        ("[1, 2]", "must be a JSON object"),
        ("{not json", "not JSON"),
        ('{"n": true}', "n must be an int"),
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
    assert req == {"messages": [{"role": "system", "content": "ab"}]}
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
        (chat(user, temperature="warm"), "temperature must be a number"),
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
        rows.append({"rid": f"r{i:02d}", "review": f"review {i} was fine", "p": json.dumps(params)})
    rows[5]["p"] = '{"temperature": "hot"}'
    with open(folder / "rows.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    struct = pa.table(
        {
            "rid": ["s0", "s1"],
            "review": ["a", "b"],
            "p": [{"max_new_tokens": 1, "n": None}, {"max_new_tokens": None, "n": 3}],
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
    assert bad[0]["error"] == "rows.jsonl line 6: params column 'p': temperature must be a number, got 'hot'"
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


def test_estimate_counts_each_requests_samples_and_tokens(tiny_model_dir, tmp_path):
    """`validate --estimate` on OpenAI requests with `n: 100000`: the time counts every sample of every
    request (and its max_tokens), not one answer a row; the calibration runs a batch of each row's samples."""
    from batchjob.job import make_spec
    from batchjob.job.estimate import estimate
    from batchjob.job.runner import prepare

    def seconds(n: int, max_tokens: int) -> tuple[float, list[str]]:
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
        return est.seconds(est.calibration), est.lines()

    one, _ = seconds(1, 4)
    many, lines = seconds(100_000, 4)
    longer, _ = seconds(100_000, 8)
    assert one > 0 and many > 1000 * one, (one, many)  # 100,000 answers a request, not one
    assert longer > 1.5 * many  # twice the tokens each
    assert any("100,000.0 samples a usable row (800,000 in the first 8)" in line for line in lines), lines
