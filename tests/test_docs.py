"""The docs name code that exists: every file path in docs/ and README.md, and every function
the architecture map names, so the map cannot drift from the code silently.

In docs/ARCHITECTURE.md, `Class.name()` must be a method of a class of that name in pdserve/;
a bare `name()` must be defined in the file named right after it (`name()` in `pdserve/x.py`,
or `name()` (`pdserve/x.py`)), else in the file named last before it.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
PATH = re.compile(
    r"^(?:[\w.-]+/)*[\w.-]+\.py$|^(?:pdserve|tests|benchmarks|scripts|docs)/[\w./-]*$"
)
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CALL = re.compile(r"^(?:[A-Za-z_]\w*\.)?[A-Za-z_]\w*\(\)$")
FOLLOWING_PATH = re.compile(r"^\s*(?:in\s+|\()`([^`]+\.py)`")
# Files the docs name as examples of what a reader would add.
EXAMPLES = {"pdserve/transfer/rdma.py"}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _resolve(token: str, tracked: list[str]) -> str | None:
    """The repository path `token` names: itself, or the shortest tracked path ending in it
    (docs may write `engine/roles/decode.py` for pdserve/engine/roles/decode.py)."""
    token = token.rstrip("/")
    if token.endswith(".py"):
        files = [t for t in tracked if t == token or t.endswith("/" + token)]
        return min(files, key=len) if files else None
    found = any(
        t == token or t.endswith("/" + token) or t.startswith(token + "/") or f"/{token}/" in t
        for t in tracked
    )
    return token if found else None


def _defined(path: Path) -> set[str]:
    """Functions and classes of a module, as `name` and `Class.name`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_in_docs_exist(doc):
    tracked = _tracked()
    text = doc.read_text()
    missing = [
        t
        for t in CODE.findall(text)
        if PATH.match(t) and t not in EXAMPLES and _resolve(t, tracked) is None
    ]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_in_docs_exist(doc):
    links = [t for t in LINK.findall(doc.read_text()) if "://" not in t]
    missing = [t for t in links if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def _methods_by_class() -> dict[str, set[str]]:
    """`Class.name` of every class in pdserve/, by class name."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "pdserve").rglob("*.py"):
        for name in _defined(path):
            if "." in name:
                out.setdefault(name.split(".")[0], set()).add(name)
    return out


def test_architecture_names_exist():
    tracked, methods = _tracked(), _methods_by_class()
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    current, checked, wrong, attached = None, 0, [], set()
    for match in CODE.finditer(text):
        token = match.group(1)
        if PATH.match(token) and token.endswith(".py"):
            if match.start() not in attached:  # a call's own file leaves the context as is
                current = _resolve(token, tracked)
            continue
        if not CALL.match(token):
            continue
        checked += 1
        name = token[:-2]
        if "." in name:
            if name not in methods.get(name.split(".")[0], ()):
                wrong.append(token)
            continue
        following = FOLLOWING_PATH.match(text[match.end() :])
        if following:
            attached.add(match.end() + following.start(1) - 1)
        path = _resolve(following.group(1), tracked) if following else current
        if path is None or name not in _defined(ROOT / path):
            wrong.append(f"{token} in {path}")
    assert checked > 50, f"only {checked} names checked: has the notation changed?"
    assert not wrong, f"docs/ARCHITECTURE.md names what the code lacks: {wrong}"
