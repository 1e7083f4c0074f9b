"""The router's answers the soak and fault scripts read: a metric's samples and each worker's
KV blocks from a `/metrics` text, the blocks still held polled until they come back, and a
completion posted with the timing header asked for."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pdserve.bench.router_stats import kv_blocks, leaked_blocks, post_completion, samples

TEXT = """# HELP pdserve_kv_blocks_free Free KV blocks.
pdserve_kv_blocks_free{worker="p0"} 60
pdserve_kv_blocks_free{worker="d0"} 12
pdserve_kv_blocks_total{worker="p0"} 64
pdserve_kv_blocks_total{worker="d0"} 12
pdserve_request_redrives_total{reason="silent"} 3.0
"""


def test_samples_and_blocks_of_a_metrics_text():
    assert samples(TEXT, "pdserve_request_redrives_total") == {'reason="silent"': 3.0}
    assert samples(TEXT, "pdserve_absent_total") == {}
    assert kv_blocks(TEXT) == {"p0": (60, 64), "d0": (12, 12)}


@pytest.fixture
def router():
    """A stand-in router: /metrics shows 4 blocks held until it has been read twice; a
    completion echoes its body and whether the timing header came."""
    reads = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            reads.append(1)
            self._send(TEXT if len(reads) < 3 else TEXT.replace("} 60", "} 64"), "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            timing = self.headers.get("X-PDServe-Timing") == "1"
            self._send(json.dumps({"body": body, "timing": timing}), "application/json")

        def _send(self, text, kind):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", reads
    server.shutdown()


def test_leaked_blocks_polls_until_every_block_is_back(router):
    url, reads = router
    assert leaked_blocks(url, timeout_s=0.2) == {"p0": 4}  # held past the time given
    assert leaked_blocks(url, timeout_s=5) == {} and len(reads) == 3


def test_a_completion_asks_for_the_timing_only_when_told(router):
    url, _ = router
    assert post_completion(url, {"prompt": "x"}, 5) == {"body": {"prompt": "x"}, "timing": False}
    assert post_completion(url, {}, 5, timing=True)["timing"] is True
