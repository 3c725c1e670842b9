"""Errors about the setup, not the row, stop a job before any work (exit 2), and ``validate`` finds them too:
a KV pool that can't hold one request of the full context, ``--max-model-len`` beyond the model's context, a
model folder that ships its own code without ``--trust-remote-code`` (which never runs, whatever stdin says).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pyarrow.dataset as ds
import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig

from batchjob import Engine
from batchjob.cli import main
from batchjob.engine.config import EngineConfig
from batchjob.engine.kv_cache import KVShape
from batchjob.errors import ConfigError, ModelNotFoundError
from tests.tiny_models import make_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i in range(5):
            review = "great product " * (40 if i == 4 else 1) + str(i)  # the last one is long
            f.write(json.dumps({"id": f"x{i}", "review": review}) + "\n")
    return path


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def job_args(data, out, model, *extra):
    return ["--input", data, "--output", out, "--model", model, "--template", "Review: {review}", *extra]


def parts(out):
    return sorted(p.name for p in out.glob("part-*")) if out.exists() else []


# -- the KV pool ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "pool", "setting"),
    [
        (["--num-blocks", "2"], "2 blocks x 16 tokens = 32 tokens", "--num-blocks"),
        (["--num-blocks", "3", "--block-size", "8"], "3 blocks x 8 tokens = 24 tokens", "--num-blocks"),
        (["--kv-memory-gb", "0.00001"], "1 blocks x 16 tokens = 16 tokens", "--kv-memory-gb"),
    ],
)
@pytest.mark.parametrize("command", ["run", "validate"])
def test_kv_pool_too_small_for_one_request_exits_2_before_any_work(
    command, extra, pool, setting, data, tiny_model_dir, tmp_path
):
    out = tmp_path / "out"
    code, text = invoke(command, *job_args(data, out, tiny_model_dir, "--device", "cpu", *extra))
    assert code == 2, text
    assert pool in text and setting in text and "Traceback" not in text
    assert "max_model_len 1024 tokens" in text  # the context that does not fit
    assert "--max-model-len" in text and "--kv-memory-gb" in text  # the fixes
    assert parts(out) == [] and not (out / "_batchjob" / "manifest.jsonl").exists()


@pytest.mark.engine
@pytest.mark.parametrize("command", ["run", "validate"])
def test_default_cpu_pool_too_small_for_a_long_context_model(command, data, tmp_path):
    # 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes a token: the 2 GiB CPU default holds
    # 4M tokens, less than this model's context of 8M.
    model = make_model(tmp_path / "long", "llama", max_position_embeddings=8 * 2**20)
    code, text = invoke(command, *job_args(data, tmp_path / "out", model, "--device", "cpu"))
    assert code == 2, text
    assert "the CPU default of 2 GiB" in text and "max_model_len 8388608 tokens" in text
    code, text = invoke(
        "validate", *job_args(data, tmp_path / "out", model, "--device", "cpu"), "--max-model-len", "4096"
    )
    assert code == 0 and "context 4096 tokens" in text, text


def test_validate_names_the_pool_it_checked(data, tiny_model_dir, tmp_path):
    code, text = invoke("validate", *job_args(data, tmp_path / "out", tiny_model_dir, "--device", "cpu"))
    assert code == 0, text
    assert "context 1024 tokens" in text and "sized by the CPU default of 2 GiB" in text
    code, text = invoke(
        "validate",
        *job_args(data, tmp_path / "out", tiny_model_dir, "--num-blocks", "2", "--max-model-len", "32"),
    )
    assert code == 0 and "2 blocks x 16 tokens = 32 tokens" in text, text


# -- --max-model-len -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "validate"])
def test_max_model_len_beyond_the_models_context_is_refused(command, data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    code, text = invoke(command, *job_args(data, out, tiny_model_dir, "--max-model-len", "1025"))
    assert code == 2, text
    assert "max_model_len 1025" in text and "context of 1024 tokens" in text and "Traceback" not in text
    assert parts(out) == []
    code, text = invoke(command, *job_args(data, out, tiny_model_dir, "--max-model-len", "1"))
    assert code == 2 and "max_model_len must be an integer >= 2" in text


def test_a_job_under_max_model_len_makes_long_prompts_error_rows(data, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = job_args(data, out, tiny_model_dir, "--num-blocks", "2", "--max-model-len", "32", "--no-chat")
    code, text = invoke("run", *args, "--max-new-tokens", "100", "--id-column", "id")
    assert code == 0, text
    rows = {r["id"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}
    assert len(rows) == 5
    assert "does not fit the context of 32 tokens" in rows["x4"]["error"]
    ok = [r for k, r in rows.items() if k != "x4"]
    assert all(r["error"] is None for r in ok)
    assert all(r["num_prompt_tokens"] + r["num_generated_tokens"] <= 32 for r in ok)
    # outputs stop at the cap, not at --max-new-tokens
    assert any(
        r["finish_reason"] == "length" and r["num_prompt_tokens"] + r["num_generated_tokens"] == 32
        for r in ok
    )
    # the cap shapes the results, so it is part of the job's identity
    code, text = invoke(
        "run",
        *job_args(data, out, tiny_model_dir, "--no-chat", "--max-new-tokens", "100", "--id-column", "id"),
    )
    assert code == 2 and "max_model_len: was 32, now None" in text


def test_engine_library_api(tiny_model_dir):
    # An explicit small pool is still the library's to ask for (the engine tests force preemption that way)...
    engine = Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=2)
    assert engine.block_manager.num_blocks == 2 and engine.max_model_len == 1024
    # ...unless the caller asks for the check, as the job layer always does.
    with pytest.raises(ConfigError, match="2 blocks x 16 tokens = 32 tokens"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu", num_blocks=2, check_kv_pool=True)
    # A pool the engine sizes itself is always checked.
    with pytest.raises(ConfigError, match="kv_memory_gb=1e-05"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu", kv_memory_gb=0.00001)
    capped = Engine.from_pretrained(str(tiny_model_dir), device="cpu", max_model_len=32, kv_memory_gb=0.00003)
    assert capped.max_model_len == 32 and capped.block_manager.num_blocks == 3
    with pytest.raises(ConfigError, match="exceeds the model's context of 1024"):
        Engine.from_pretrained(str(tiny_model_dir), device="cpu", max_model_len=2048)


def test_pool_arithmetic_from_the_config_alone():
    shape = KVShape.from_config(
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    )
    cpu = EngineConfig(device=torch.device("cpu"), dtype=torch.float32, block_size=16, max_num_seqs=4)
    assert cpu.planned_num_blocks(shape, 1024) == 4 * 64 + 1  # never more than every seat at full context
    assert "CPU default" in cpu.kv_pool_source
    cuda = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, block_size=16, cuda_graphs=False)
    assert cuda.planned_num_blocks(shape, 1024) is None  # decided by profiling the loaded model
    assert "gpu_memory_utilization" in cuda.kv_pool_source
    cpu.check_kv_fits(64, 1024)
    with pytest.raises(ConfigError, match=r"--max-model-len N \(N <= 1008\)"):
        cpu.check_kv_fits(63, 1024)
    with pytest.raises(ConfigError, match="max_model_len must be an integer >= 2"):
        EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=1)


# -- a model folder with its own code ---------------------------------------------------------------------------

_CUSTOM_CODE = """\
from pathlib import Path

Path({marker!r}).write_text("the model's own code ran")

from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "batchjob_custom"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture()
def custom_code_model(tiny_model_dir, tmp_path):
    """The tiny llama under a model type transformers does not know, with code in the folder (auto_map) that
    leaves a marker file when imported. Returns (folder, marker)."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "MARKER"
    (folder / "custom_model.py").write_text(_CUSTOM_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "batchjob_custom"
    config["architectures"] = ["CustomForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "custom_model.CustomConfig",
        "AutoModelForCausalLM": "custom_model.CustomForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def _yes_y(command, data, out, model, tmp_path, *extra):
    """``yes y | python -m batchjob COMMAND ...``: a real process that would answer yes to any question."""
    args = [sys.executable, "-m", "batchjob", command, *map(str, job_args(data, out, model, *extra))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    return subprocess.run(
        f"yes y | {shlex.join(args)}", shell=True, capture_output=True, text=True, env=env, timeout=150
    )


@pytest.mark.process  # `yes y | python -m batchjob ...`
@pytest.mark.parametrize("command", ["run", "validate"])
def test_model_code_never_runs_without_trust_remote_code(command, custom_code_model, data, tmp_path):
    folder, marker = custom_code_model
    out = tmp_path / "out"
    proc = _yes_y(command, data, out, folder, tmp_path, "--device", "cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"model folder {folder}: it ships its own Python code; rerun with --trust-remote-code if you trust it"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert parts(out) == []


def test_engine_refuses_model_code_without_the_flag(custom_code_model):
    folder, marker = custom_code_model
    with pytest.raises(ModelNotFoundError, match="it ships its own Python code"):
        Engine.from_pretrained(str(folder), device="cpu")
    assert not marker.exists()


def test_a_tokenizer_with_its_own_code_is_refused_too(tiny_model_dir, data, tmp_path):
    folder = tmp_path / "custom_tokenizer"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "MARKER"
    (folder / "custom_tok.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass MyTok(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "MyTok", "auto_map": {"AutoTokenizer": [None, "custom_tok.MyTok"]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for command in ("validate", "run"):
        code, text = invoke(command, *job_args(data, tmp_path / "out", folder, "--device", "cpu"))
        assert code == 2 and "it ships its own Python code; rerun with --trust-remote-code" in text, text
    assert not marker.exists() and parts(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("file", "auto_map", "instead"),
    [
        ("config.json", {"AutoModelForCausalLM": "custom_model.LlamaForCausalLM"}, "built-in 'llama' class"),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "custom_model.Tok"]}, "built-in class"),
    ],
)
@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_known_model_type_that_ships_its_own_code_is_refused(
    command, file, auto_map, instead, tiny_model_dir, data, tmp_path
):
    """transformers would run its built-in llama class (or tokenizer) for this folder without a word; the
    folder's authors named their own code, so without --trust-remote-code it is refused before any work."""
    folder = tmp_path / "llama_with_code"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "MARKER"
    (folder / "custom_model.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
    )
    config = json.loads((folder / file).read_text())
    config["auto_map"] = auto_map
    (folder / file).write_text(json.dumps(config))
    out = tmp_path / "out"
    code, text = invoke(command, *job_args(data, out, folder, "--device", "cpu"))
    assert code == 2, text
    assert (
        f"model folder {folder}: it ships its own Python code; rerun with --trust-remote-code if you trust it "
        f"(an auto_map in its {file} names code for {next(iter(auto_map))}), or delete auto_map from its "
        f"{file} to use transformers' {instead}"
    ) in text
    assert not marker.exists() and parts(out) == []


@pytest.mark.parametrize("method", ["gptq", "a_method_transformers_skips"])
def test_a_quantized_checkpoint_is_refused_by_name(method, tiny_model_dir, data, tmp_path):
    """validate said ok and run died in transformers' ImportError (GPTQ without optimum); a quant_method
    transformers does not know was skipped and the job ran the folder's weights as if unquantized."""
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    for command in ("validate", "run"):
        code, text = invoke(command, *job_args(data, tmp_path / "out", folder, "--device", "cpu"))
        assert code == 2, text
        assert f"model folder {folder} is quantized (quantization_config, quant_method '{method}')" in text
    assert parts(tmp_path / "out") == []


@pytest.mark.process  # `yes y | python -m batchjob ...`
def test_trust_remote_code_runs_it_and_is_not_part_of_the_identity(custom_code_model, data, tmp_path):
    folder, marker = custom_code_model
    out = tmp_path / "out"
    extra = ("--device", "cpu", "--max-new-tokens", "2", "--no-chat")
    proc = _yes_y("run", data, out, folder, tmp_path, *extra, "--trust-remote-code")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists() and len(ds.dataset(out, format="parquet").to_table()) == 5
    marker.unlink()
    # The same job without the flag is the same job: refused for the model's code, not for a changed identity.
    proc = _yes_y("run", data, out, folder, tmp_path, *extra)
    assert proc.returncode == 0 and "already complete" in proc.stdout, proc.stdout + proc.stderr
    assert not marker.exists()


def test_bench_takes_max_model_len(tiny_model_dir):
    bench = ["bench", "--model", str(tiny_model_dir), "--device", "cpu"]
    code, text = invoke(*bench, "--max-model-len", "2048")
    assert code == 2 and "exceeds the model's context of 1024" in text, text
    code, text = invoke(*bench, "--max-model-len", "64", "--prompt-len", "60", "--output-len", "8")
    assert code == 2 and "exceeds the model's context of 64 tokens" in text, text
