"""deploy/grafana/pdserve.json queries only series the router exports (a renamed metric
would leave a panel empty without any error)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from tests.router.test_metrics import ROW

GRAFANA = Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"


def test_every_queried_series_is_exported():
    metrics = RouterMetrics()
    metrics.record_finished(0.1, 0.5, 4, 3, itl_s=[0.2, 0.2], ttft_parts_s={"prefill": 0.1})
    metrics.requests["success"] += 1
    text = metrics.render([{**ROW, "role": "decode", "cpus": [0], "threads": 1}], 0)
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\bpdserve_\w+", expr)}
    assert len(queried) >= 15
    assert queried - exported == set()
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for word in (
        "Workers",
        "first token",
        "breakdown",
        "output token",
        "Inter-token",
        "throughput",
        "Queue",
        "KV blocks",
        "hit rate",
        "transfer",
    ):
        assert word in titles, word
