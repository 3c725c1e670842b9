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


# The size budget (STYLE.md 17): a function over 60 lines (``def`` line to last line, decorators excluded) or a
# module over 500 lines fails, unless listed here with its length today. An entry may only shrink: one that
# grew fails, and so does one no longer needed (the code is under the limit, or gone), so the lists hold at
# most what is left to cut.
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
MAX_FUNCTIONS_ALLOWED = 3
FUNCTIONS_ALLOWED: dict[str, int] = {}
MODULES_ALLOWED: dict[str, int] = {}


def _function_sizes(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method under ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _function_sizes(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _function_sizes(node, f"{prefix}{node.name}.")


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Every function's length by ``file:qualified.name``, and every module's by file (paths under batchjob/)."""
    functions: dict[str, int] = {}
    modules: dict[str, int] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        modules[name] = len(source.splitlines())
        for qualname, length in _function_sizes(ast.parse(source, str(path))):
            functions[f"{name}:{qualname}"] = max(length, functions.get(f"{name}:{qualname}", 0))
    return functions, modules


def over_budget(found: dict[str, int], allowed: dict[str, int], limit: int) -> list[str]:
    """What breaks the budget: an unlisted item over ``limit``, a listed one that grew, a listed one not needed."""
    problems = []
    for name, length in sorted(found.items()):
        if length > limit and name not in allowed:
            problems.append(f"{name} is {length} lines (limit {limit})")
        elif name in allowed and length > allowed[name]:
            problems.append(f"{name} grew to {length} lines (allowed {allowed[name]}, limit {limit})")
    for name, length in sorted(allowed.items()):
        if found.get(name, 0) <= limit:
            now = f"is {found[name]} lines" if name in found else "is gone"
            problems.append(f"{name} {now}, within the limit of {limit}: remove its allow-list entry ({length})")
    return problems


def test_budget_checker():
    """The checker itself, on made-up figures: unlisted and over, listed and grown, listed and no longer needed."""
    found = {"a.py:f": 61, "a.py:g": 70, "a.py:h": 50, "a.py:k": 80}
    allowed = {"a.py:g": 65, "a.py:h": 62, "a.py:gone": 90, "a.py:k": 80}
    assert over_budget(found, allowed, 60) == [
        "a.py:f is 61 lines (limit 60)",
        "a.py:g grew to 70 lines (allowed 65, limit 60)",
        "a.py:gone is gone, within the limit of 60: remove its allow-list entry (90)",
        "a.py:h is 50 lines, within the limit of 60: remove its allow-list entry (62)",
    ]
    source = "def f():\n    def g():\n        pass\n\nclass C:\n    @property\n    def m(self):\n        return 1\n"
    assert dict(_function_sizes(ast.parse(source))) == {"f": 3, "f.g": 2, "C.m": 2}


def test_functions_and_modules_within_budget():
    functions, modules = sizes()
    problems = over_budget(functions, FUNCTIONS_ALLOWED, MAX_FUNCTION_LINES)
    problems += over_budget(modules, MODULES_ALLOWED, MAX_MODULE_LINES)
    assert not problems, "size budget (tests/test_layout.py):\n" + "\n".join(problems)


def test_function_allow_list_is_short():
    """At most 3 functions may stay over the limit. (No module may: MODULES_ALLOWED holds only what other
    branches are cutting, and empties when they merge.)"""
    assert len(FUNCTIONS_ALLOWED) <= MAX_FUNCTIONS_ALLOWED, sorted(FUNCTIONS_ALLOWED)
