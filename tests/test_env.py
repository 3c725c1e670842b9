"""The environment's on/off switches: a value that is no on/off word is refused before any work, naming the
variable and the values it takes (BATCHJOB_CPU_KERNEL=disable kept the kernel on without a word)."""

from __future__ import annotations

import importlib

import pytest
from click.testing import CliRunner

from batchjob import env
from batchjob.cli import main
from batchjob.engine.config import EngineConfig
from batchjob.errors import ConfigError

REFUSED = "environment variable BATCHJOB_CPU_KERNEL='disable' is not an on/off value: set it to 0, false"


def test_a_switch_takes_on_off_words_and_refuses_anything_else(monkeypatch):
    name = "BATCHJOB_CPU_KERNEL"
    for value, want in [
        ("0", False),
        (" OFF ", False),
        ("No", False),
        ("1", True),
        ("yes", True),
        ("", True),
    ]:
        monkeypatch.setenv(name, value)
        assert env.flag(name) is want
    monkeypatch.delenv(name)
    assert env.flag(name) is True
    monkeypatch.setenv(name, "disable")
    with pytest.raises(ConfigError, match=REFUSED):
        env.flag(name)
    with pytest.raises(ConfigError, match=REFUSED):  # an engine's options are checked with the switches
        EngineConfig(device="cpu")


def test_every_switch_a_module_reads_is_listed():
    names = set()
    for module in ("heap", "rows", "platform", "linear", "kernel"):
        found = importlib.import_module(f"batchjob.engine.cpu.{module}")
        names |= {v for k, v in vars(found).items() if k.endswith("_ENV") and v.startswith("BATCHJOB_CPU_")}
    assert names == set(env.FLAGS)


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_bad_switch_exits_2_before_any_work(command, tiny_model_dir, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    monkeypatch.setenv("BATCHJOB_CPU_KERNEL", "disable")
    out = tmp_path / "out"
    args = [command, "--input", str(data), "--output", str(out), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and REFUSED in result.output, result.output
    assert "Traceback" not in result.output and not list(out.glob("*.parquet"))
