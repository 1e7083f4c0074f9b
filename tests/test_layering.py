"""The control plane imports no torch (docs/ARCHITECTURE.md, "Invariants"): router, bench and
the simulator reuse it in processes that never load a model. And pdserve's packages form
layers: no two import each other, through any chain of imports."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_imports import import_graph, module_names

TORCH_FREE = [
    "pdserve.kvcache.manager",
    "pdserve.engine.scheduler",
    "pdserve.output_processor",
    "pdserve.sampling_params",
    "pdserve.config",
    "pdserve.costmodel.step_cost",
    "pdserve.costmodel.profile",
    "pdserve.costmodel.analytic",
    "pdserve.perf.cli",
    "pdserve.sim.simulator",
    "pdserve.sim.plan",
    "pdserve.sim.cli",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def package_graph(modules: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """Subpackage -> subpackage it imports -> the importing modules, from a module graph.
    A top-level module (pdserve.config) is a package of its own, the root __init__ too."""

    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    graph: dict[str, dict[str, set[str]]] = {package(m): {} for m in modules}
    for module, targets in modules.items():
        for target in targets:
            if package(target) != package(module):
                graph[package(module)].setdefault(package(target), set()).add(module)
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_package_import_cycle():
    """No two of pdserve's packages import each other, through any chain, counting imports
    inside functions and type-only ones: each package sits on a layer (docs/ARCHITECTURE.md,
    "Packages")."""
    graph = package_graph(import_graph(module_names()))
    assert "engine" in graph["perf"] and "costmodel" in graph["engine"]
    found = cycles(graph)
    edges = [
        f"{a} -> {b}: {', '.join(sorted(graph[a][b]))}"
        for component in found
        for a in component
        for b in component
        if b in graph[a]
    ]
    assert not found, "package cycles " + str(found) + "\n" + "\n".join(edges)


def test_cost_model_is_a_leaf():
    """The step-cost model and profiles import nothing of the runtime: the engine, workers,
    router, planner and simulator all build on it, and `pdserve profile` (perf) above them."""
    graph = package_graph(import_graph(module_names()))
    assert set(graph["costmodel"]) <= {"schema"}
    assert "router" not in graph["planner"]


def test_cycles_finds_one_through_a_function_level_import():
    modules = {
        "pdserve.a.x": {"pdserve.b.y"},
        "pdserve.b.y": {"pdserve.c.z"},
        "pdserve.c.z": {"pdserve.a.x"},
        "pdserve.d": {"pdserve.a.x"},
    }
    assert cycles(package_graph(modules)) == [["a", "b", "c"]]
    assert cycles(package_graph({"pdserve.a.x": {"pdserve.b.y"}, "pdserve.b.y": set()})) == []


def test_architecture_lists_the_layers_that_hold():
    """docs/ARCHITECTURE.md's package map is true: every package is on one line, and imports
    only packages on lower lines."""
    text = (Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Packages", 1)[1].split("```", 2)[1]
    rows = [line.split("  ", 1)[0].split(", ") for line in block.strip().splitlines()]
    layer = {name: -i for i, row in enumerate(rows) for name in row}  # the bottom row is 0
    graph = package_graph(import_graph(module_names()))
    del graph["pdserve"]  # the root __init__, above everything
    assert sorted(layer) == sorted(graph)
    upward = [f"{a} -> {b}" for a in graph for b in graph[a] if layer[b] >= layer[a]]
    assert not upward
