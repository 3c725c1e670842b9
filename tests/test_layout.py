"""The package's import graph, read with ``ast`` (nothing is imported): no module imports itself in a circle,
counting imports under ``TYPE_CHECKING`` and inside functions, and the engine hides no import in a function
without saying why."""

from __future__ import annotations

import ast
from pathlib import Path

import batchjob

ROOT = Path(batchjob.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("batchjob", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:
                    target = f"{base}.{a.name}"
                    if target in mods:
                        edges[name].add(target)
                    elif base in mods:
                        edges[name].add(base)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (and modules that import themselves)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges[v]:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_finds_a_circle():
    """The checker itself: a made-up graph with a circle of three and one of one."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(circles(edges)) == [["a", "b", "c"], ["e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_reads_every_kind_of_import():
    edges = import_graph()
    assert "batchjob.engine.request" in edges["batchjob.engine.scheduler"]  # from x.y import Name
    assert "batchjob.engine.speculative" in edges["batchjob.engine.engine"]  # from package import module
    assert "batchjob.engine.engine" in edges["batchjob.engine"]  # inside a function


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (TYPE_CHECKING and function-level imports count): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def _says_why(lines: list[str], i: int) -> bool:
    """A comment on the import's line, or above the block of imports it belongs to."""
    if "#" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1
    return lines[i - 1].strip().startswith("#")


def test_engine_imports_in_functions_say_why():
    """An import inside a function in ``engine/`` is for something heavy or optional, and says so in a
    comment on its line or the line above; never a way around a circle."""
    silent = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not _says_why(lines, node.lineno - 1):
                    silent.append(
                        f"{path.relative_to(ROOT.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                    )
    assert not silent, "imports inside functions without a reason:\n" + "\n".join(silent)
