"""The prefill-only tasks (embed, classify, score) on a vision-language model: refused by name before the
weights are read, by the job (run and validate, with or without an image column) and by the engine."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.jobproc import run_here
from tests.tiers import engine_fixture
from tests.vision_models import make_llava

pytestmark = pytest.mark.timeout(300)


@engine_fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava") / "llava")


@pytest.mark.parametrize("task", ["embed", "classify", "score"])
def test_a_task_on_a_vlm_is_refused_before_the_weights(llava, tmp_path, task):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Paris is"}) + "\n")
    args = ["--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--model", llava, "--task", task]
    code, output = run_here([*args, "--device", "cpu"])
    assert code == 2, output
    assert f"--task {task}: model 'llava' (llava) is a vision-language model" in output, output
    assert "Loading weights" not in output  # refused from the config alone
    assert not (tmp_path / "out" / "_batchjob" / "manifest.jsonl").exists()
    from batchjob.cli import main

    result = CliRunner().invoke(main, ["validate", *map(str, args)])
    assert result.exit_code == 2 and "is a vision-language model" in result.output, result.output


def test_a_task_with_an_image_column_is_refused(llava, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Paris is", "image": None}) + "\n")
    args = ["--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--model", llava]
    code, output = run_here([*args, "--task", "embed", "--image-column", "image"])
    assert code == 2 and "--image-column is for generation over rows" in output, output


def test_the_engine_refuses_a_task_on_a_vlm(llava):
    from batchjob import Engine
    from batchjob.errors import ConfigError

    with pytest.raises(ConfigError, match="vision-language models with task='embed' are not supported"):
        Engine.from_pretrained(str(llava), task="embed", device="cpu")
