"""The measurement scripts (``measurements/``) and the user's example script stay runnable: each one's
``--help`` exits 0 with a usage line, and ``measurements/README.md`` indexes every script. No test runs a
measurement itself (they take minutes); this catches an import or an argument list that rotted."""

from __future__ import annotations

import os
import subprocess
import sys
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [*runner, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.lower().startswith("usage:"), result.stdout


def test_index_names_every_script() -> None:
    index = (MEASUREMENTS / "README.md").read_text(encoding="utf-8")
    missing = [s for s in SCRIPTS if s.startswith("measurements/") and s.removeprefix("measurements/") not in index]
    assert not missing, f"measurements/README.md does not describe {missing}"
