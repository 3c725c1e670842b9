"""The test tiers themselves: a test's tier comes from the fixtures it uses, and a test in a tier doing what
the tier forbids fails, saying how to mark it."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest

from tests.tiers import TierGuard, TierViolation, engine_fixture, process_fixture


@engine_fixture
def pretend_model():
    """Declared as a model fixture (it builds nothing: the tier comes from the declaration)."""
    return "model"


@pytest.fixture
def through_another(pretend_model):
    return pretend_model


@process_fixture
def pretend_process():
    return "process"


@contextmanager
def refused(match: str):
    """The guard refuses what the block does; the refusal, expected here, is then forgotten (a refusal the
    code under test swallowed would otherwise fail the test at its end)."""
    with pytest.raises(TierViolation, match=match):
        yield
    TierGuard.active.violations.clear()


def _tier(request) -> list[str]:
    return [t for t in ("unit", "engine", "process") if request.node.get_closest_marker(t)]


def test_no_tier_fixture_is_unit_and_may_start_no_process(request):
    assert _tier(request) == ["unit"]
    with refused("is in the unit tier .* mark this test engine/process"):
        subprocess.run(["true"], check=False)


def test_no_tier_fixture_is_unit_and_may_load_no_model(request, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with refused("builds or loads a model: mark this test engine/process"):
        LlamaForCausalLM(LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1))
    with refused("loads a tokenizer"):
        AutoTokenizer.from_pretrained(str(tmp_path))


def test_a_model_fixture_makes_an_engine_test_that_may_start_no_batchjob(request, through_another):
    assert _tier(request) == ["engine"]
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0  # a compiler's worker
    for argv in (
        [sys.executable, "-m", "batchjob", "--help"],
        [sys.executable, "-c", "import batchjob"],
        f"echo | {sys.executable} -m batchjob --help",
    ):
        with refused("is in the engine tier .* starts a batchjob process .* mark this test process"):
            subprocess.run(argv, check=False, shell=isinstance(argv, str))


def test_a_process_fixture_wins(request, pretend_model, pretend_process):
    assert _tier(request) == ["process"]
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0


@pytest.mark.engine
def test_a_marker_sets_the_tier_too(request):
    assert _tier(request) == ["engine"]


def test_the_guard_undoes_its_patches():
    popen = subprocess.Popen._execute_child
    with TierGuard("t", "engine"):
        assert subprocess.Popen._execute_child is not popen
    assert subprocess.Popen._execute_child is popen
