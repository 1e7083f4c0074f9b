"""pdserve's modules import each other without a cycle, function-level and type-only imports
included: a cycle makes import order matter and hides which layer depends on which. And no
function is over ruff's complexity limits."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (packages by their __init__)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body. An import of a name
    from a package counts as an import of that submodule when one has the name; a package's
    __init__ is a target only when imported for a name of its own."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        base = module if is_package else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                name = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    up = base.split(".")[: len(base.split(".")) - node.level + 1]
                    name = ".".join(up + ([name] if name else []))
                subs = {f"{name}.{a.name}" for a in node.names} & modules.keys()
                targets |= subs or {name}
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycle_in_pdserve():
    graph = import_graph(module_names())
    assert graph["pdserve.cluster.up"] >= {"pdserve.cluster.config", "pdserve.cluster.launcher"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_a_lazy_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_over_the_complexity_limits():
    """Functions that fit on a screen: ruff's C901 (cyclomatic complexity), PLR0912
    (branches) and PLR0915 (statements), with pyproject.toml's limits and no exceptions.
    Modules are split by concept, not by length."""
    root = ROOT.parent
    rules, paths = "C901,PLR0912,PLR0915", ["pdserve", "tests", "benchmarks"]
    argv = [sys.executable, "-m", "ruff", "check", "--select", rules, *paths]
    result = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_formats_every_file():
    """`ruff format` decides the layout of every Python file (the version pinned in
    pyproject.toml's dev extra): no hand-packed lines, no `# fmt: skip`."""
    argv = [sys.executable, "-m", "ruff", "format", "--check", "pdserve", "tests", "benchmarks"]
    result = subprocess.run(argv, cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
