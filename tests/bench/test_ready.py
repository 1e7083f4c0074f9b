"""`pdserve bench` waits for the server's GET /health before sending (bench/client.py,
wait_until_ready): start-up refusals are not counted as the run's."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from pdserve.bench.client import ClientConfig, wait_until_ready


class _Health(http.server.BaseHTTPRequestHandler):
    statuses: list[int] = []
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(f"{self.path} {self.headers.get('Authorization')}")
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b'{"status": "unavailable"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health() -> Iterator[tuple[str, type[_Health]]]:
    handler = type("Handler", (_Health,), {"statuses": [], "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    server.shutdown()


def test_waits_through_503_until_200(health):
    url, handler = health
    handler.statuses = [503, 503, 200]
    wait_until_ready(ClientConfig(url, "m", api_key="k"), poll_s=0.01)
    assert handler.seen == ["/health Bearer k"] * 3


def test_a_server_without_health_is_ready(health):
    url, handler = health
    handler.statuses = [404]
    wait_until_ready(ClientConfig(url + "/chat/completions", "m"), poll_s=0.01)
    assert handler.seen == ["/health None"]


def test_a_refused_key_names_the_flag(health):
    url, handler = health
    handler.statuses = [401]
    with pytest.raises(ValueError, match="--api-key"):
        wait_until_ready(ClientConfig(url, "m", api_key="wrong"), poll_s=0.01)


def test_never_ready_names_the_flag_and_the_last_answer(health):
    url, handler = health
    handler.statuses = [503]
    with pytest.raises(ValueError, match=r"--ready-timeout-s 0.2: .* not ready \(503"):
        wait_until_ready(ClientConfig(url, "m", ready_timeout_s=0.2), poll_s=0.01)


def test_zero_does_not_wait():
    wait_until_ready(ClientConfig("http://127.0.0.1:9/v1", "m", ready_timeout_s=0))
