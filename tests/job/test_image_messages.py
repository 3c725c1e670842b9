"""Chat messages on a vision-language model (a messages column, --format openai, --image-column's user message)
follow a text model's rules (``chat_messages.py``, ``rendered.py``), over the tiny LLaVA: developer is system,
an unknown role, an empty message and a final assistant message are row errors, a message the processor's chat
template leaves out is said, and a template that drops --system is refused before work."""

from __future__ import annotations

import json

import pytest

from tests.jobproc import read_results, run_here
from tests.tiers import engine_fixture
from tests.vision_models import make_image, make_llava

pytestmark = pytest.mark.timeout(600)

IMAGE = {"type": "image_url", "image_url": {"url": "three.png"}}


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


def _run(tmp_path, folder, rows, *extra, out="out"):
    """A messages-column job of ``rows`` (rid: messages): its exit code, output and rows by rid."""
    make_image(3).save(tmp_path / "three.png")
    with open(tmp_path / "chats.jsonl", "w") as f:
        for rid, messages in rows.items():
            f.write(json.dumps({"rid": rid, "messages": messages}) + "\n")
    args = ["--input", tmp_path / "chats.jsonl", "--output", tmp_path / out, "--model", folder]
    args += ["--id-column", "rid", "--max-new-tokens", 4, "--dtype", "float64", "--logprobs", "0", *extra]
    code, output = run_here(args)
    got = {r["rid"]: r for r in read_results(tmp_path / out)} if code == 0 else {}
    return code, output, got


def test_a_messages_column_on_a_vlm_follows_the_text_models_rules(llava, tmp_path):
    """A developer message is a system message (it was written as a 'developer' turn); 'narrator', an empty
    message and a final assistant message are row errors naming the message (they were taken); a message of
    an image alone is no empty one."""
    user = {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}
    rows = {
        "developer": [{"role": "developer", "content": "Be brief."}, user],
        "system": [{"role": "system", "content": "Be brief."}, user],
        "narrator": [{"role": "narrator", "content": "Once upon a time."}, user],
        "empty": [{"role": "user", "content": "  "}],
        "image_only": [{"role": "user", "content": [IMAGE]}],
        "answered": [user, {"role": "assistant", "content": "A picture."}],
    }
    code, output, got = _run(tmp_path, llava, rows)
    assert code == 0, output
    assert got["system"]["error"] is None and got["image_only"]["error"] is None
    assert got["developer"]["logprobs"] == got["system"]["logprobs"]
    assert "column 'messages': messages[0].role 'narrator' is not a role" in got["narrator"]["error"]
    assert "column 'messages': messages[0].content is empty (a user message" in got["empty"]["error"]
    ends = "column 'messages': the conversation ends with an assistant message (messages[1])"
    assert ends in got["answered"]["error"]


def _dropping_system(llava, folder):
    """A copy of the tiny LLaVA whose processor's chat template leaves system messages out (as Phi-3's first
    template wrote no system turn)."""
    import shutil

    shutil.copytree(llava, folder)
    loop, kept = (
        "{% for message in messages %}",
        "{% for message in messages if message['role'] != 'system' %}",
    )
    for name in ("chat_template.jinja", "chat_template.json"):
        path = folder / name
        if path.exists():
            text = path.read_text()
            assert loop in text, name
            path.write_text(text.replace(loop, kept))
    return folder


def test_a_processor_template_that_drops_a_message_is_said(llava, tmp_path):
    """A system message the processor's template leaves out is the row's error naming it (a messages column's,
    an OpenAI request's), and --system is refused before any work by run and validate, --image-column's jobs
    included (the probe was skipped: --system changed nothing); the row without one is fine."""
    from click.testing import CliRunner

    from batchjob.cli import main

    folder = _dropping_system(llava, tmp_path / "llava")
    user = {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}
    rows = {"system": [{"role": "system", "content": "Answer in French."}, user], "plain": [user]}
    code, output, got = _run(tmp_path, folder, rows)
    assert code == 0, output
    assert got["plain"]["error"] is None, got["plain"]["error"]
    said = "column 'messages': the chat template leaves messages[0] (a system message) out of the prompt"
    assert said in got["system"]["error"], got["system"]["error"]
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": messages}}
        for cid, messages in rows.items()
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--input", tmp_path / "requests.jsonl", "--output", tmp_path / "openai", "--model", folder]
    code, output = run_here([*args, "--format", "openai", "--dtype", "float64", "--max-new-tokens", 2])
    assert code == 0, output
    got = {r["custom_id"]: r for r in read_results_by(tmp_path / "openai")}
    assert got["plain"]["error"] is None, got["plain"]["error"]
    assert "the chat template leaves body.messages[0] (a system message) out" in got["system"]["error"]
    (tmp_path / "images.jsonl").write_text(json.dumps({"rid": "a", "prompt": "What?", "image": "three.png"}))
    for command, out in (("run", "image_run"), ("validate", "image_validate")):
        args = [command, "--input", tmp_path / "images.jsonl", "--output", tmp_path / out, "--model", folder]
        args += ["--image-column", "image", "--system", "Answer in French.", "--max-new-tokens", 2]
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2, result.output
        assert "leaves the --system message out of the prompt it renders" in result.output, result.output
        assert not list(tmp_path.glob(f"{out}/**/*.parquet"))  # before any work


def read_results_by(out) -> list[dict]:
    import pyarrow.dataset as ds

    return ds.dataset(out, format="parquet").to_table().to_pylist()


def test_an_image_conversation_job_an_earlier_batchjob_started_is_not_resumed(llava, tmp_path):
    """The rules above changed what an image job writes for some rows: one an earlier batchjob started would
    be finished half one way and half the other. Its identity says so (the rendering tag image-messages-v2),
    for --image-column and for a messages column on a vision-language model."""
    from batchjob.io.atomic import read_json, write_json

    rows = {"a": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}]}
    code, output, _ = _run(tmp_path, llava, rows)
    assert code == 0, output
    job = tmp_path / "out" / "_batchjob" / "job.json"
    saved = read_json(job)
    assert saved["fingerprint"]["prompt"]["rendering"] == ["image-messages-v2", "messages-v2"]
    saved["fingerprint"]["prompt"]["rendering"] = ["messages-v2"]  # as an earlier batchjob's
    write_json(job, saved)
    code, output, _ = _run(tmp_path, llava, rows)
    assert code == 2, output
    said = (
        "prompt.rendering: was ['messages-v2'], now ['image-messages-v2', 'messages-v2'] (a vision-language"
    )
    assert said in output and "finish it with the batchjob that started it" in output, output
    (tmp_path / "images.jsonl").write_text(json.dumps({"rid": "a", "prompt": "What?", "image": "three.png"}))
    args = ["--input", tmp_path / "images.jsonl", "--output", tmp_path / "images", "--model", llava]
    code, output = run_here([*args, "--image-column", "image", "--id-column", "rid", "--max-new-tokens", 2])
    assert code == 0, output
    assert read_json(tmp_path / "images" / "_batchjob" / "job.json")["fingerprint"]["prompt"][
        "rendering"
    ] == ["image-messages-v2"]
