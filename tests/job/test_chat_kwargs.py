"""--chat-template-kwargs are checked against the chat template that renders the prompts: a key it never reads
is refused by run and validate before any work (it would change no prompt), with TOML's table rule named where
the key is a job field a job file put below its [chat_template_kwargs] header."""

from __future__ import annotations

import json
import shutil

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.errors import ConfigError
from batchjob.job.chat_kwargs import check_job_kwargs, check_kwargs
from batchjob.job.prompts import plan_prompts
from batchjob.job.spec import make_spec

pytestmark = pytest.mark.timeout(300)

THINKING = (  # reads enable_thinking, as Qwen3's does
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


@pytest.fixture
def thinker(tiny_model_dir, tmp_path):
    """The tiny llama with a chat template that reads enable_thinking."""
    from transformers import AutoTokenizer

    folder = tmp_path / "thinker"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": f"review {i}"}) + "\n" for i in range(4)))
    return path


def test_job_file_fields_below_the_kwargs_table_are_refused_by_validate_and_run(thinker, data, tmp_path):
    """TOML puts every key after [chat_template_kwargs] into the table: system, max-new-tokens and stop became
    template kwargs, validate said ok and the rows ran to 128 tokens without the system prompt."""
    out = tmp_path / "out"
    head = f'input = "{data}"\noutput = "{out}"\nmodel = "{thinker}"\nid-column = "id"\n'
    fields = 'system = "You label reviews."\nmax-new-tokens = 2\nstop = ["\\n"]\n'
    trapped = tmp_path / "trapped.toml"
    trapped.write_text(head + "\n[chat_template_kwargs]\nenable_thinking = false\n\n" + fields)
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, str(trapped)])
        assert result.exit_code == 2, result.output
        assert "chat template never reads 'system', 'max-new-tokens', 'stop'" in result.output
        assert "reads enable_thinking" in result.output
        assert "TOML puts every key after the [chat_template_kwargs] header into that table" in result.output
    assert not list(out.glob("*.parquet"))  # refused before any row
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(head + fields + "\n[chat_template_kwargs]\nenable_thinking = false\n")
    result = CliRunner().invoke(main, ["run", str(fixed)])
    assert result.exit_code == 0, result.output
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    assert len(rows) == 4 and all(r["num_generated_tokens"] <= 2 for r in rows)


def test_a_misspelt_kwarg_on_the_command_line_is_refused_naming_what_the_template_reads(
    thinker, data, tmp_path
):
    args = ["--input", str(data), "--output", str(tmp_path / "o"), "--model", str(thinker)]
    typo = ["--chat-template-kwargs", '{"enable_thinkng": false}']
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, *args, "--max-new-tokens", "2", *typo])
        assert result.exit_code == 2, result.output
        assert "never reads 'enable_thinkng', so it would change no prompt" in result.output
        assert "(the template reads enable_thinking; a misspelt key?)" in result.output
        assert "TOML" not in result.output  # not a job field
    assert not list((tmp_path / "o").glob("*.parquet"))


def test_a_template_that_reads_nothing_of_its_own_takes_no_kwargs(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # its template reads only the messages
    with pytest.raises(ConfigError, match="never reads 'enable_thinking'.*reads no variable of its own"):
        check_kwargs({"enable_thinking": False}, tokenizer)


def test_named_templates_are_checked_by_the_one_rendered(tiny_model_dir):
    """A dict of named templates renders its 'default' (batchjob passes no tools)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = {
        "default": THINKING,
        "tool_use": THINKING.replace("enable_thinking", "tool_mode"),
    }
    check_kwargs({"enable_thinking": False}, tokenizer)
    with pytest.raises(ConfigError, match="never reads 'tool_mode'"):
        check_kwargs({"tool_mode": True}, tokenizer)


def test_a_resumed_job_is_told_to_start_a_new_output(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="started with it by an earlier batchjob.*give a new --output"):
        check_kwargs({"seed": 3}, tokenizer, resumed=True)


@pytest.mark.engine  # builds a tiny vision-language model
def test_image_rows_are_checked_against_the_processors_template(tmp_path):
    """Image rows render through the processor's template, not the tokenizer's."""
    from transformers import AutoConfig, AutoTokenizer

    from tests.vision_models import make_llava

    folder = make_llava(tmp_path / "llava")
    tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    tokenizer.chat_template = THINKING  # the tokenizer's reads enable_thinking; the processor's does not
    kwargs = '{"enable_thinking": false}'
    text = make_spec(model=str(folder), chat_template_kwargs=kwargs)
    check_job_kwargs(text, plan_prompts(text, ["text"], True), tokenizer, config, False)
    images = make_spec(model=str(folder), image_column="image", chat_template_kwargs=kwargs)
    with pytest.raises(ConfigError, match="the processor's chat template never reads 'enable_thinking'"):
        check_job_kwargs(images, plan_prompts(images, ["text", "image"], True), tokenizer, config, False)


def _requests(tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [
        {"custom_id": "chat", "url": "/v1/chat/completions", "method": "POST"}
        | {"body": {"messages": [{"role": "user", "content": "Paris is"}], "max_tokens": 2}},
        {"custom_id": "completion", "url": "/v1/completions", "method": "POST"}
        | {"body": {"prompt": "Paris is", "max_tokens": 2}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_kwargs_with_openai_requests_on_a_tokenizer_without_a_template_are_refused(tiny_model_dir, tmp_path):
    """--format openai on a tokenizer without a chat template took the kwargs and ran (exit 0): no request
    goes through a template there, as --no-chat's prompts do not, which is refused."""
    from transformers import AutoTokenizer

    folder = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    args = ["--input", _requests(tmp_path), "--output", tmp_path / "o", "--model", folder]
    args += ["--format", "openai"]
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}']
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, *map(str, args), *kwargs])
        assert result.exit_code == 2, result.output
        assert "this model's tokenizer has none, so no request goes through one" in result.output
    assert not list((tmp_path / "o").glob("*.parquet"))


def test_a_completions_request_in_a_job_with_kwargs_is_its_rows_error(thinker, tmp_path):
    """A completions request's prompt does not go through the chat template: the kwargs were dropped from it
    without a word (as --system on such a request is its row's error)."""
    out = tmp_path / "o"
    args = ["run", "--input", _requests(tmp_path), "--output", out, "--model", thinker, "--format", "openai"]
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}']
    result = CliRunner().invoke(main, [*map(str, args), *kwargs])
    assert result.exit_code == 0, result.output
    rows = {r["custom_id"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}
    assert rows["chat"]["error"] is None
    assert "a completions request (a 'prompt') does not go through" in rows["completion"]["error"]
