"""Environment variables are named and read in pdserve/envs.py alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pdserve
from pdserve import envs


def test_only_envs_reads_the_environment():
    root = Path(pdserve.__file__).parent
    readers = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"\bos\.environ\b|\bgetenv\(|\"PDSERVE_", path.read_text())
    }
    assert readers == {"envs.py"}


def test_secret_and_child_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.CLUSTER_SECRET, raising=False)
    with pytest.raises(ValueError, match="PDSERVE_CLUSTER_SECRET must hold the cluster secret"):
        envs.cluster_secret()
    monkeypatch.setenv(envs.CLUSTER_SECRET, "0g")
    with pytest.raises(ValueError, match="PDSERVE_CLUSTER_SECRET is not valid hex"):
        envs.cluster_secret()
    child = envs.child_env(b"\x01\x02", api_key="k")
    assert child[envs.CLUSTER_SECRET] == "0102" and child[envs.API_KEY] == "k"
    monkeypatch.delenv(envs.API_KEY, raising=False)
    assert envs.api_key() is None and envs.API_KEY not in envs.child_env(b"\x01")
