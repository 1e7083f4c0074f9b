"""Environment variables are named and read in pdserve/envs.py alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.parametrize(
    ("operator", "expected"),
    [
        ({}, envs.WORKER_SPINCOUNT),
        ({envs.OMP_WAIT_POLICY: "active"}, None),
        ({envs.GOMP_SPINCOUNT: "5"}, "5"),
    ],
)
def test_worker_sets_the_spin_count_before_torch_loads(operator, expected):
    """The worker entry point applies pdserve's OpenMP spin count (libgomp reads it once, when
    torch loads it) unless the operator chose a wait policy."""
    code = (
        "import os, sys\nfrom pdserve.workers import main\ntry:\n    main.main([])\n"
        "except SystemExit:\n    pass\n"
        f"print('torch' in sys.modules, os.environ.get({envs.GOMP_SPINCOUNT!r}))"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in (envs.OMP_WAIT_POLICY, envs.GOMP_SPINCOUNT)
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **operator},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["False", str(expected)]


def test_step_trace_sets_the_folder_and_puts_it_back(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.STEP_TRACE, "/elsewhere")
    with envs.step_trace(tmp_path):
        assert envs.step_trace_dir() == tmp_path
    assert envs.step_trace_dir() == Path("/elsewhere")
    monkeypatch.delenv(envs.STEP_TRACE)
    with envs.step_trace(tmp_path):
        assert envs.step_trace_dir() == tmp_path
    assert envs.step_trace_dir() is None
