"""A messages column's conversation as the chat template gets it: the rules of an OpenAI request's messages
(roles, developer as system), and nothing of it dropped or answered twice without a word."""

from __future__ import annotations

import pytest

from batchjob.job.prompts import PromptBuilder, plan_prompts
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
    parts = [{"type": "text", "text": "Paris is"}, {"type": "text", "text": " the capital"}]
    assert b.text({"m": [{"role": "user", "content": parts}]})[0] == b.text({"m": [USER]})[0]


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
