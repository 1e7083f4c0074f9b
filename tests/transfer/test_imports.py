"""The package's import graph: no cycles (lazy and type-only imports included), and the
names the control plane reads (backends, modes, layouts, bandwidth) load without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pdserve.transfer

PACKAGE = Path(pdserve.transfer.__file__).parent


def transfer_imports(path: Path) -> set[str]:
    """Modules of pdserve.transfer that ``path`` imports anywhere in its body."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "pdserve.transfer":
            names |= {a.name for a in node.names if (PACKAGE / f"{a.name}.py").exists()}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "pdserve.transfer."
        ):
            names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names |= {
                a.name.split(".")[2] for a in node.names if a.name.startswith("pdserve.transfer.")
            }
    return names - {path.stem}


def test_no_import_cycle_inside_the_package() -> None:
    graph = {p.stem: transfer_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}

    def visit(module: str, path: list[str]) -> None:
        for dep in graph.get(module, ()):
            assert dep not in path, f"import cycle: {' -> '.join([*path, dep])}"
            visit(dep, [*path, dep])

    for module in graph:
        visit(module, [module])


def test_control_plane_names_import_without_torch() -> None:
    code = (
        "import sys; from pdserve.transfer import BACKENDS, TRANSFER_MODES, KVLayout, "
        "parse_bandwidth; print('torch' in sys.modules)"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
