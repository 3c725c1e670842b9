"""A command imports only what it needs: `batchjob --help` and `batchjob status` start without torch or
transformers (seconds of imports before any work), in a fresh interpreter as a user's shell would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchjob.job import make_spec, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]  # each test starts a fresh interpreter

HEAVY = ("torch", "transformers", "tokenizers")

PROBE = f"""
import json, sys
from batchjob.cli import main
try:
    main(sys.argv[1:], prog_name="batchjob")
except SystemExit as e:
    code = e.code
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def _imports(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_imports_no_torch():
    got = _imports("--help")
    assert got == {"code": 0, "heavy": []}


def test_status_imports_no_torch(tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    spec = make_spec(
        input=[str(data)], output=str(out), model=str(tiny_model_dir), max_new_tokens=2, chat=False
    )
    assert run_job(spec).status == "complete"
    got = _imports("status", str(out))
    assert got == {"code": 0, "heavy": []}
