"""A messages column's conversation as the chat template gets it: the rules of an OpenAI request's messages
(roles, developer as system), and nothing of it dropped or answered twice without a word."""

from __future__ import annotations

import json

import pytest

from batchjob.errors import ConfigError
from batchjob.job.prompts import PromptBuilder, check_render, plan_prompts
from batchjob.job.requests import parse_request
from batchjob.job.spec import JobSpec, make_spec
from batchjob.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

USER = {"role": "user", "content": "Paris is the capital"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)  # its template writes each role as given


def builder(tokenizer, **spec):
    return PromptBuilder(plan_prompts(JobSpec(messages_column="m", **spec), ["m"], True), tokenizer, 256)


def test_a_developer_message_is_a_system_message_and_an_unknown_role_is_the_rows_error(tokenizer):
    """A messages column's roles went to the template as given: 'developer' (OpenAI's name for the system
    message, which --format openai maps) rendered as a 'developer' turn, and 'narrator' was taken."""
    b = builder(tokenizer)
    text, error = b.text({"m": [{"role": "developer", "content": "Be terse."}, USER]})
    assert error is None and text.startswith("<|im_start|>system\nBe terse.<|im_end|>"), text
    text, error = b.text({"m": [{"role": "narrator", "content": "Once"}, USER]})
    assert text is None and "messages[0].role 'narrator' is not a role" in error, error
    assert "system, developer, user, assistant, tool" in error
    # --system goes first unless the conversation starts with its own, a developer message included
    dev = {"m": [{"role": "developer", "content": "Be terse."}, USER]}
    assert builder(tokenizer, system="Be long.").text(dev)[0] == b.text(dev)[0]
    parts = [{"type": "text", "text": "Paris is"}, {"type": "text", "text": "the capital"}]  # joined as vLLM
    joined = {"m": [USER | {"content": "Paris is\nthe capital"}]}
    assert b.text({"m": [{"role": "user", "content": parts}]})[0] == b.text(joined)[0]


def test_a_message_with_empty_content_is_the_rows_error(tokenizer):
    """A message with content "" (or only whitespace) was generated over, while an empty prompt column is
    refused; an OpenAI request's message goes through the same rule."""
    for content in ("", "  \n"):
        error = builder(tokenizer).build(
            {"m": [{"role": "system", "content": "Be terse."}, USER | {"content": content}]}
        )[1]
        assert error is not None and "messages[1].content is empty (a user message" in error, error
        body = {"messages": [USER, {"role": "assistant", "content": content}, USER]}
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
        error = parse_request(line, SamplingParams(), None)[2]
        assert error is not None and "body.messages[1].content is empty" in error, error


def test_a_conversation_that_ends_with_an_assistant_message_is_the_rows_error(tokenizer):
    """An SFT set's messages end with the reference answer: the template opened a new assistant turn after
    it, and every row generated a follow-up to its own answer without a word. A task that reads the
    conversation as it is (a reward model's score) still takes it."""
    answered = {"m": [USER, {"role": "assistant", "content": "of France."}]}
    error = builder(tokenizer).build(answered)[1]
    assert error is not None and "ends with an assistant message (messages[1])" in error, error
    assert "drop the final message (e.g. messages[:-1])" in error
    read = PromptBuilder(
        plan_prompts(make_spec(task="score", messages_column="m"), ["m"], True), tokenizer, None
    )
    assert read.build(answered)[1] is None


PHI3_FIRST = (  # Phi-3's first template: no system turn at all
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}"
    "{% endfor %}"
)
PHI3_LATER = (  # a later Phi-3 template: system, user and assistant turns; a tool message is skipped
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{'<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
GEMMA = (  # Gemma's: a system message is refused
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
TOOL_AS_JSON = (  # Llama 3.1's way with a tool's result: a string is iterable, so it is written as JSON text
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\\n{% if message['role'] == 'tool' %}"
    "{{ message['content'] | tojson }}{% else %}{{ message['content'] | trim }}{% endif %}<|im_end|>\\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)


def with_template(tiny_model_dir, template):
    from transformers import AutoTokenizer  # (a fresh tokenizer for each template)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = template
    return tokenizer


def test_a_message_the_chat_template_leaves_out_is_the_rows_error(tiny_model_dir):
    """A template drops what it does not know without a word: the later Phi-3 template skipped a tool
    message, and the row was answered as if it had none. A template that writes a tool's result as JSON
    text, and one that trims a message, still take the row."""
    tool = {"role": "tool", "content": '{"temp": 3}'}
    b = builder(with_template(tiny_model_dir, PHI3_LATER))
    error = b.build({"m": [USER, tool, {"role": "user", "content": "And now?"}]})[1]
    said = "column 'm': the chat template leaves messages[1] (a tool message) out"
    assert error is not None and said in error, error
    assert (
        builder(with_template(tiny_model_dir, PHI3_LATER), system="Be terse.").build({"m": [USER]})[1] is None
    )
    for template in (TOOL_AS_JSON, GEMMA):
        messages = [USER | {"content": "  Paris is the capital\n"}, tool, {"role": "user", "content": "And?"}]
        assert builder(with_template(tiny_model_dir, template)).build({"m": messages})[1] is None


@pytest.mark.parametrize(
    ("template", "said"),
    [(PHI3_FIRST, "leaves the --system message out"), (GEMMA, "(TemplateError: System role not supported)")],
)
def test_system_a_template_drops_or_rejects_is_refused_before_work(tiny_model_dir, template, said):
    """--system "Answer only in French." with Phi-3's first template changed nothing (no system turn), and
    with Gemma's every row was an error while the job said complete: one probe render at setup refuses."""
    tokenizer = with_template(tiny_model_dir, template)
    for kind, columns in (
        (JobSpec(system="Answer only in French."), ["prompt"]),
        (JobSpec(messages_column="m", system="x y"), ["m"]),
    ):
        plan = plan_prompts(kind, columns, True)
        with pytest.raises(ConfigError, match="leave out --system, or put its text into the prompt") as e:
            check_render(kind, plan, tokenizer)
        assert said in str(e.value) and tiny_model_dir.name in str(e.value), str(e.value)
    check_render(JobSpec(), plan_prompts(JobSpec(), ["prompt"], True), tokenizer)  # no --system: fine


def test_run_and_validate_refuse_a_system_message_the_template_rejects(tiny_model_dir, tmp_path):
    """Gemma's template with --system: validate said ok, and run took every row to the same error and said
    complete. Both now stop before work (exit 2) with the template's own message."""
    import shutil  # (only this test copies a model folder)

    from click.testing import CliRunner  # (only this test runs the command line)

    from batchjob.cli import main

    folder = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir, folder)
    with_template(tiny_model_dir, GEMMA).save_pretrained(folder)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"review {i}"}) + "\n" for i in range(3)))
    args = [
        "--input",
        str(data),
        "--output",
        str(tmp_path / "out"),
        "--model",
        str(folder),
        "--system",
        "Be terse.",
    ]
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, *args, "--max-new-tokens", "2"])
        assert result.exit_code == 2, result.output
        assert "rejects a conversation of --system and a user message" in result.output
        assert "System role not supported" in result.output
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_chat_template_kwargs_naming_the_conversation_are_refused_before_work():
    """'{"messages": []}' passed validate, then every row was an error naming a TypeError (the template and
    transformers' renderer get the conversation under 'messages' and 'conversations')."""
    for key in ("messages", "conversations"):
        with pytest.raises(ConfigError, match=f"chat_template_kwargs: '{key}' is the name the chat template"):
            make_spec(input=["x.jsonl"], output="o", chat_template_kwargs=json.dumps({key: []}))


def test_a_messages_job_an_earlier_batchjob_started_is_not_resumed(tiny_model_dir, tmp_path):
    """Roles, empty content, a final assistant message and dropped messages changed what a messages-column
    job writes for some rows: one an earlier batchjob started would be finished half one way and half the
    other. Its identity says so (a list of rendering tags); a job of plain prompts keeps its identity."""
    from click.testing import CliRunner  # (only these tests run the command line)

    from batchjob.cli import main
    from batchjob.io.atomic import read_json, write_json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [USER], "prompt": f"p {i}"}) + "\n" for i in range(2)))

    def run(name, *given):
        args = ["run", "--input", str(data), "--output", str(tmp_path / name), "--model", str(tiny_model_dir)]
        return CliRunner().invoke(main, [*args, *given, "--max-new-tokens", "2"])

    assert run("p", "--prompt-column", "prompt").exit_code == 0
    assert "rendering" not in read_json(tmp_path / "p" / "_batchjob" / "job.json")["fingerprint"]["prompt"]
    assert run("m", "--messages-column", "messages").exit_code == 0
    saved = read_json(tmp_path / "m" / "_batchjob" / "job.json")
    assert saved["fingerprint"]["prompt"].pop("rendering") == ["messages-v2"]  # as an earlier batchjob's
    write_json(tmp_path / "m" / "_batchjob" / "job.json", saved)
    result = run("m", "--messages-column", "messages")
    assert result.exit_code == 2, result.output
    said = "prompt.rendering: was None, now ['messages-v2'] (chat messages (a messages column"
    assert said in result.output and "finish it with the batchjob that started it" in result.output
