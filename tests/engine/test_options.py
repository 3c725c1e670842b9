"""The engine's options, declared once (``engine/options.py``): the job spec, job files, the command line and
``Engine.from_pretrained`` all take their names, defaults and checks from the declarations."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from batchjob.cli import main
from batchjob.engine.config import EngineConfig
from batchjob.engine.options import EngineOptions, by_engine_name, declared, job_options
from batchjob.errors import ConfigError
from batchjob.job.spec import JobSpec, make_spec
from batchjob.job.spec import declared as spec_declared


def test_every_job_option_is_a_spec_field_with_the_declared_default():
    spec_options = {name: (f, opt) for name, f, opt in spec_declared()}
    for name, f, opt in job_options():
        assert name in spec_options, name
        assert spec_options[name] == (f, opt), name  # the engine's own declaration, by its job name
    assert JobSpec().engine.as_keywords() == EngineOptions(check_kv_pool=True).as_keywords()
    names = {name for name, _, _ in job_options()}
    assert "prefix_caching" in names and "enable_prefix_caching" not in names
    assert not {"static_batching", "check_kv_pool"} & names  # the job layer sets these itself
    options = make_spec(admission="static", prefix_caching=False).engine.as_keywords()
    assert options["static_batching"] and not options["enable_prefix_caching"] and options["check_kv_pool"]
    assert set(options) == {f.name for f, _ in declared()}  # the task options too (--task, --pooling, ...)


@pytest.mark.parametrize("command", ["run", "validate", "bench"])
def test_every_job_option_is_a_flag_with_the_declared_help(command):
    params = {p.name: p for p in main.commands[command].params}
    for name, _, opt in job_options():
        if command == "bench" and name == "task":  # the bench's own --task (its runs differ per task)
            assert tuple(params["task"].type.choices) == opt.choices
            continue
        assert name in params, (command, name)
        assert params[name].help == opt.help
        assert params[name].default is None  # left out: the job file's value, else the engine's default
        flag = "--" + name.replace("_", "-")
        assert flag in params[name].opts, (command, name)
        if opt.kind is bool:
            assert "--no-" + flag[2:] in params[name].secondary_opts


def test_from_pretrained_takes_every_option_by_name():
    from batchjob import Engine

    signature = inspect.signature(Engine.from_pretrained)
    assert any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    with pytest.raises(TypeError, match="no_such_option"):
        Engine.from_pretrained(no_such_option=1)


def test_from_pretrained_takes_the_options_as_one_object_a_keyword_winning(tiny_model_dir, monkeypatch):
    from batchjob import Engine
    from batchjob.job import runner

    options = EngineOptions(device="cpu", dtype="float64", max_num_seqs=3, num_blocks=32)
    with pytest.raises(ConfigError, match="max_num_seqs must be an integer >= 1, got 0"):
        Engine.from_pretrained(str(tiny_model_dir), options=options, max_num_seqs=0)  # checked before loading
    assert Engine.from_pretrained(str(tiny_model_dir), options=options).config.max_num_seqs == 3
    engine = Engine.from_pretrained(str(tiny_model_dir), options=options, max_num_seqs=5)
    assert (engine.config.max_num_seqs, engine.config.num_blocks, engine.config.dtype) == (
        5,
        32,
        torch.float64,
    )
    # A job's engine is built from its spec's object (the job sets static batching and the pool check).
    seen = {}
    monkeypatch.setattr(Engine, "from_pretrained", lambda model, **kw: seen.update(kw, model=model))
    spec = make_spec(model="m", device="cpu", admission="static")
    runner.load_engine(spec)
    assert seen == {"model": "m", "trust_remote_code": False, "options": spec.engine, "lora": None}
    assert spec.engine.static_batching and spec.engine.check_kv_pool and spec.engine.device == "cpu"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1, got 0"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens must be an integer >= 1, got 0"),
        ("block_size", -1, "block_size must be an integer >= 1"),
        ("num_blocks", 0, "num_blocks must be an integer >= 1"),
        ("max_model_len", 1, "max_model_len must be an integer >= 2 (a prompt token and one more), got 1"),
        ("num_speculative_tokens", 65, "num_speculative_tokens must be an integer in [0, 64], got 65"),
        ("kv_memory_gb", 0, "kv_memory_gb must be a finite number > 0, got 0"),
        ("kv_memory_gb", float("inf"), "kv_memory_gb must be a finite number > 0, got inf"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ("device", "tpu", "device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        ("dtype", "int8", "dtype must be one of auto, float32, float64, bfloat16, float16; got 'int8'"),
        (
            "attention_backend",
            "flash2",
            "attention_backend must be one of auto, flex, torch, cpu, flash, varlen; got 'flash2'",
        ),
    ],
)
def test_one_check_for_the_library_and_the_job(name, value, message):
    with pytest.raises(ConfigError) as engine_error:
        EngineConfig(**{name: value})
    with pytest.raises(ConfigError) as job_error:
        make_spec(**{name: value})
    assert message in str(engine_error.value)
    assert str(job_error.value) == str(engine_error.value)


def test_the_engine_checks_types_too():
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be an integer >= 1, got True"):
        EngineConfig(max_num_batched_tokens=True)
    with pytest.raises(ConfigError, match="compile must be true or false, got 'yes'"):
        EngineConfig(compile="yes")


def test_none_means_the_engine_decides():
    given = EngineOptions(gpu_memory_utilization=None, enable_prefix_caching=None, device=None)
    assert given.gpu_memory_utilization == 0.9 and given.enable_prefix_caching is True
    assert given.device == "auto" and given.max_num_seqs is None  # for EngineConfig to decide
    config = EngineConfig(device="cpu", max_num_seqs=None, cuda_graphs=None)
    assert config.device == torch.device("cpu") and config.dtype == torch.float32
    assert (config.max_num_seqs, config.block_size, config.cuda_graphs) == (64, 16, False)
    # a job's options left out are the engine's defaults too
    assert EngineConfig(**make_spec(device="cpu").engine.as_keywords()).max_num_seqs == 64


def test_per_device_defaults_are_declared_once(monkeypatch):
    """What the engine decides per device is in the declarations: EngineConfig resolves from them, and the
    help shows them (no default restated by hand)."""
    decided = {f.name: opt for f, opt in declared() if opt.per_device}
    assert set(decided) == {"dtype", "max_num_batched_tokens", "max_num_seqs", "kv_memory_gb", "cuda_graphs"}
    assert decided["max_num_batched_tokens"].help.endswith("(default: 8192 on CUDA, 512 on CPU).")
    cpu = EngineConfig(device="cpu")
    for name in ("max_num_batched_tokens", "max_num_seqs", "cuda_graphs"):
        assert getattr(cpu, name) == decided[name].device_default("cpu"), name
    assert cpu.dtype == torch.float32 and cpu.kv_memory_gb is None and cpu.default_kv_memory_gb == 2.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = EngineConfig(device="cuda")
    assert (cuda.max_num_batched_tokens, cuda.max_num_seqs, cuda.cuda_graphs) == (8192, 256, True)
    assert cuda.dtype == torch.bfloat16 and cuda.block_size in (16, 256)  # the backend's (flash: 256)
    # The block size is the chosen backend's, forced or not.
    assert EngineConfig(device="cuda", attention_backend="varlen").block_size == 256
    assert EngineConfig(device="cpu", attention_backend="flex").block_size == 16


def test_the_cpu_step_budget_follows_the_models_widest_activation(tiny_model_dir):
    """On the CPU a generating engine left to decide takes 2,048 tokens a step where the MLP's inner
    activation over 2,048 tokens fits glibc's largest mmap threshold (32 MiB), else 512; a budget given, or a
    prefill-only task, keeps its own."""
    from transformers import Gemma3nTextConfig, GPT2Config, Qwen2Config

    from batchjob import Engine
    from batchjob.engine.config import cpu_step_tokens

    half, large = Qwen2Config(intermediate_size=4864), Qwen2Config(intermediate_size=8960)  # 0.5B, 1.5B
    assert cpu_step_tokens(half, torch.bfloat16) == 2048  # 19.9 MB
    assert cpu_step_tokens(half, torch.float32) == cpu_step_tokens(large, torch.bfloat16) == 512  # 40, 37 MB
    assert cpu_step_tokens(GPT2Config(n_embd=768), torch.float32) == 2048  # n_inner None: 4 x 768, 25 MB
    assert cpu_step_tokens(GPT2Config(n_embd=1280), torch.float32) == 512  # 42 MB
    per_layer = Gemma3nTextConfig(intermediate_size=[1024, 8960], num_hidden_layers=2)  # the widest counts
    assert cpu_step_tokens(per_layer, torch.bfloat16) == 512
    decided = Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=32)
    assert decided.config.max_num_batched_tokens == decided.scheduler.max_num_batched_tokens == 2048
    given = Engine.from_pretrained(
        str(tiny_model_dir), device="cpu", num_blocks=32, max_num_batched_tokens=512
    )
    assert given.config.max_num_batched_tokens == 512
    score = Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=32, task="score")
    assert score.config.max_num_batched_tokens == 512


def test_a_backend_that_cannot_run_is_refused_before_work(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    with pytest.raises(ConfigError, match="attention backend varlen cannot run here: it needs a CUDA device"):
        EngineConfig(device="cpu", attention_backend="varlen")
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(
        main,
        ["validate", "--input", str(data), "--output", str(tmp_path / "out"), "--model", str(tiny_model_dir),
         "--device", "cpu", "--attention-backend", "varlen"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "attention backend varlen cannot run here: it needs a CUDA device" in result.output
    assert "Traceback" not in result.output


def test_job_files_keep_their_names(tmp_path):
    (tmp_path / "j.toml").write_text("prefix-caching = false\nmax_num_seqs = 3\ndtype = 'float64'\n")
    spec = make_spec(tmp_path / "j.toml", max_num_seqs=5)
    engine = spec.engine
    assert engine.enable_prefix_caching is False and engine.max_num_seqs == 5 and engine.dtype == "float64"
    assert by_engine_name({"prefix_caching": False, "max_num_seqs": 5}) == {
        "enable_prefix_caching": False,
        "max_num_seqs": 5,
    }
    with pytest.raises(ConfigError, match="max_num_seqs must be an int, got 2.5"):
        make_spec(max_num_seqs=2.5)
    # Two wrong values: the first in the order of the flags is reported, the job's own or the engine's.
    with pytest.raises(ConfigError, match="^n must be an int, got '2'$"):
        make_spec(n="2", max_num_seqs=0)
    with pytest.raises(ConfigError, match="^max_num_seqs must be an integer >= 1, got 0$"):
        make_spec(lookahead=0, max_num_seqs=0)  # the engine's options come before --lookahead
    with pytest.raises(ConfigError, match="job file .*: unknown field 'engine'"):
        (tmp_path / "e.toml").write_text("engine = 1\n")
        make_spec(tmp_path / "e.toml")  # the engine's options are flat in a job file


@pytest.mark.process  # a fresh interpreter
def test_the_command_line_loads_no_torch():
    code = "import sys, batchjob.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
