"""The API key: what it guards, and headers an attacker may send that are not even UTF-8."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import requests

from pdserve.router.config import RouterConfig
from tests.router.harness import Cluster

KEY = {"Authorization": "Bearer sekret"}


def raw_get(cluster: Cluster, path: str, header: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1]))) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
        return sock.recv(65536)


def test_health_and_metrics_can_be_protected(tokenizer_dir: Path, script: list[int]) -> None:
    config = {"api_key": "sekret", "protect_health_metrics": True}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, **config) as c:
        for path in ("/health", "/metrics", "/v1/models", "/v1/nope", "/nope"):
            r = requests.get(f"{c.url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert requests.get(f"{c.url}/health", headers=KEY).status_code == 200
        assert requests.get(f"{c.url}/metrics", headers=KEY).status_code == 200
        assert requests.get(f"{c.url}/nope", headers=KEY).status_code == 404


def test_protecting_without_a_key_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="protect_health_metrics needs api_key"):
        RouterConfig(protect_health_metrics=True)


def test_undecodable_headers_get_4xx_never_500(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, api_key="sekret") as c:
        reply = raw_get(c, "/v1/models", b"Authorization: Bearer \xff\xfe\x80sekret")
        assert reply.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in reply
        reply = raw_get(c, "/v1/models", b"Authorization: Bearer sekret\r\nX-Junk: \xff\xc3(")
        assert reply.startswith(b"HTTP/1.1 200 ")  # bytes in a header nobody reads: harmless
        reply = raw_get(c, "/health", b"X-Junk: \x00\x01")
        assert b" 400 " in reply.split(b"\r\n")[0]  # aiohttp's parser refuses control bytes
        assert requests.get(f"{c.url}/v1/models", headers=KEY).status_code == 200
