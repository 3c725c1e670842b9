"""Test tiers, decided by what a test uses (``tests/conftest.py`` applies them).

- ``process``: the test uses a process fixture (one made with :func:`process_fixture`, such as ``launch``),
  directly or through other fixtures, or is marked ``@pytest.mark.process``.
- ``engine``: the test uses a model fixture (one made with :func:`engine_fixture`, such as
  ``tiny_model_dir``), or is marked ``@pytest.mark.engine`` (or ``gpu``).
- ``unit``: everything else. A unit test runs under a guard: building or loading a model (any transformers
  model, so also through our ``Engine.from_pretrained`` or a job) or a tokenizer, or starting a process
  (``subprocess``, ``multiprocessing``), fails it with a message saying to mark it engine/process. An
  engine test runs under a lighter one: starting a batchjob process fails it.

A fixture that builds or loads a model is declared with ``@engine_fixture(...)`` instead of
``@pytest.fixture(...)`` (same arguments); one that starts processes, with ``@process_fixture(...)``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest

TIERS = ("unit", "engine", "process")  # in rising order: a test takes the highest tier it touches


def _tier_fixture(tier: str, function=None, **kwargs):
    def declare(f):
        f.test_tier = tier  # read back by conftest from the fixture's definition
        return pytest.fixture(**kwargs)(f)

    return declare(function) if function is not None else declare


def engine_fixture(function=None, **kwargs):
    """``pytest.fixture`` for a fixture that builds or loads a model: the tests using it are ``engine``."""
    return _tier_fixture("engine", function, **kwargs)


def process_fixture(function=None, **kwargs):
    """``pytest.fixture`` for a fixture that starts processes: the tests using it are ``process``."""
    return _tier_fixture("process", function, **kwargs)


def tier_of(item) -> str:
    """The tier of a collected test: its markers and the tiers of every fixture it uses."""
    found = {"unit"}
    found.update(t for t in ("engine", "process") if item.get_closest_marker(t))
    if item.get_closest_marker("gpu"):
        found.add("engine")
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        for name in item.fixturenames:
            for fixturedef in info.name2fixturedefs.get(name, ()):
                tier = getattr(fixturedef.func, "test_tier", None)
                if tier:
                    found.add(tier)
    return max(found, key=TIERS.index)


_INHERITED = object()  # an attribute the guard shadowed on a class that did not define it itself


class TierViolation(pytest.fail.Exception):
    """Raised by the unit guard. A ``BaseException`` (as ``pytest.fail``'s is), so that no ``except
    Exception`` in the code under test can turn it into an error row or a log line."""


class TierGuard:
    """While active, what the test's tier may not do raises :class:`TierViolation`, and every such attempt is
    remembered (``violations``) in case the code under test swallowed the raise.

    ``unit``: no model or tokenizer built or loaded, no process started. ``engine``: no batchjob process
    (``batchjob run``, ``python -m batchjob``, a fresh interpreter importing it), which is what the
    ``process`` tier is for; compilers and their workers (the CPU kernel, inductor) may run.
    ``process``: anything.
    """

    active: TierGuard | None = None  # the innermost guard in force

    def __init__(self, nodeid: str, tier: str):
        self.nodeid, self.tier = nodeid, tier
        self._outer: TierGuard | None = None
        self.violations: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def _refuse(self, what: str):
        if self.tier == "unit":
            uses, fix = (
                "no model or process fixture",
                "engine/process (@pytest.mark.engine, @pytest.mark.process)",
            )
            fixtures = "tiny_model_dir, launch"
        else:
            uses, fix, fixtures = "no process fixture", "process (@pytest.mark.process)", "launch"
        message = (
            f"{self.nodeid} is in the {self.tier} tier (it uses {uses}), but it {what}: mark this test {fix}, "
            f"or give it the fixture it needs ({fixtures}; a fixture of its own that builds a model or starts a "
            "process is declared with engine_fixture or process_fixture, tests/tiers.py)"
        )
        self.violations.append(message)
        raise TierViolation(message, pytrace=False)

    def _patch(self, owner, name: str, replacement):
        self._undo.append((owner, name, owner.__dict__.get(name, _INHERITED)))
        setattr(owner, name, replacement)

    def _refusing(self, what: str):
        def refused(*args, **kwargs):
            self._refuse(what)

        return refused

    def __enter__(self):
        import multiprocessing.process
        import subprocess

        self._outer, TierGuard.active = TierGuard.active, self
        if self.tier == "process":
            return self
        self._patch(
            multiprocessing.process.BaseProcess, "start", self._refusing("starts a process (multiprocessing)")
        )
        if self.tier == "engine":
            start = subprocess.Popen._execute_child
            guard = self

            def start_unless_batchjob(popen, args, executable, *rest, **kwargs):
                # Popen's own (private) signature: shell comes eighth after args and executable
                shell = rest[7] if len(rest) > 7 else kwargs.get("shell", False)
                if isinstance(args, (str, bytes)):
                    argv = ["/bin/sh", "-c", args] if shell else [args]
                else:
                    argv = ["/bin/sh", "-c", *args] if shell else list(args)
                if _starts_batchjob(executable or argv[0], argv[1:]):
                    guard._refuse(f"starts a batchjob process ({' '.join(map(os.fsdecode, argv))[:200]})")
                return start(popen, args, executable, *rest, **kwargs)

            self._patch(subprocess.Popen, "_execute_child", start_unless_batchjob)
            return self
        self._patch(
            multiprocessing.process.BaseProcess, "start", self._refusing("starts a process (multiprocessing)")
        )
        from transformers import PreTrainedModel, PreTrainedTokenizerBase

        from batchjob.engine.cpu import kernel

        # The compiled CPU decode kernel is part of the engine as installed, built once per machine (and
        # probed once per session) by the C++ compiler: found before the guard, so that a unit test may
        # resolve engine options or call the kernel, but never compiles it.
        kernel.load()
        self._patch(subprocess.Popen, "_execute_child", self._refusing("starts a process (subprocess)"))
        # Every way to a model (our Engine.from_pretrained, a job, sentence-transformers, from_config) builds
        # a PreTrainedModel; Engine.from_pretrained itself stays callable for its argument checks.
        self._patch(PreTrainedModel, "__init__", self._refusing("builds or loads a model"))
        refused = self._refusing("loads a tokenizer")
        self._patch(PreTrainedTokenizerBase, "from_pretrained", classmethod(refused))
        return self

    def __exit__(self, *exc):
        TierGuard.active = self._outer
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        return False


_SHELLS = {"sh", "bash", "dash", "zsh"}


def _starts_batchjob(program, args) -> bool:
    """Whether a process about to start (its program and arguments, as Popen got them) is a batchjob: the
    console script, or a Python interpreter or shell whose arguments name batchjob (``-m batchjob``,
    ``-c "import batchjob..."``, ``sh -c "... python -m batchjob ..."``)."""
    program = os.fsdecode(program)
    name = os.path.basename(program)
    if name == "batchjob":
        return True
    if name not in _SHELLS and not _is_python(program):
        return False
    return any(re.search(r"\bbatchjob\b", os.fsdecode(a)) for a in args)


def _is_python(program: str) -> bool:
    """Whether ``program`` is a Python interpreter, or a script whose first line names one."""
    if re.fullmatch(r"python[\d.]*", os.path.basename(program)):
        return True
    path = shutil.which(program)
    if path is None:
        return False
    if os.path.realpath(path) == os.path.realpath(sys.executable):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first
