"""The process entry: config from JSON + the secret from the environment; no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.main import parse_config

WORKERS = [{"worker_id": "p0", "role": "prefill", "address": "tcp://127.0.0.1:5601"}]


def test_parse_config_reads_json_and_hex_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "00ff")
    config = parse_config(["--config-json", json.dumps({"port": 9000, "workers": WORKERS})])
    assert config.port == 9000 and config.secret == b"\x00\xff"
    assert config.workers[0].role == "prefill"
    assert "secret" not in repr(config)


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "00ff")
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    config = parse_config(["--config-json", json.dumps({"api_key": None})])
    assert config.api_key == "from-env" and "from-env" not in repr(config)


def test_admin_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "00ff")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin-env")
    config = parse_config(["--config-json", "{}"])
    assert config.admin_key == "admin-env" and "admin-env" not in repr(config)


@pytest.mark.parametrize(
    ("data", "env", "problem"),
    [
        ({}, None, "PDSERVE_CLUSTER_SECRET must hold"),
        ({}, "zz", "not valid hex"),
        ({"prot": 1}, "00", "unknown key .prot. in router config"),
        ({"policy": "random"}, "00", "policy must be one of"),
        ({"workers": [{"worker_id": "x", "role": "boss", "address": "a"}]}, "00", "role"),
    ],
)
def test_bad_config_names_the_problem(
    monkeypatch: pytest.MonkeyPatch, data: dict, env: str | None, problem: str
) -> None:
    if env is None:
        monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", env)
    with pytest.raises(ValueError, match=problem):
        parse_config(["--config-json", json.dumps(data)])


def test_config_rejects_duplicate_workers() -> None:
    with pytest.raises(ValueError, match="duplicate worker_id"):
        RouterConfig(workers=tuple(WORKERS * 2))


def test_router_loads_a_tokenizer_without_torch(tokenizer_dir: Path) -> None:
    """The control plane is torch-free: the router never imports torch (tokenizer included)."""
    code = (
        "import sys; from pdserve.router import main, server; "
        "from pdserve.router.config import RouterConfig; "
        f"server.load_router_tokenizer(RouterConfig(model_path={str(tokenizer_dir)!r})); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_main_exits_with_one_line_on_bad_config() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.router.main", "--config-json", "{"],
        env={"PDSERVE_CLUSTER_SECRET": "00", "PATH": ""},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("pdserve router: --config-json is not valid JSON")


def test_main_serves_health_and_stops_on_sigterm(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The launcher's exact command line: it comes up, answers /health (503: no worker is
    Ready yet), and exits 0 on SIGTERM."""
    import os
    import signal
    import socket
    import time

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "port": port,
        "model": "tiny",
        "model_path": str(tokenizer_dir),
        "ctrl_address": f"ipc://{tmp_path}/ctrl",
        "workers": [{"worker_id": "c0", "role": "collocated", "address": f"ipc://{tmp_path}/c0"}],
    }
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": "ab" * 16}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.router.main", "--config-json", json.dumps(config)],
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 503 and r.json()["workers"]["c0"]["ready"] is False
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
