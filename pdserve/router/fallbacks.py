"""Counters of the paths a request takes when the planned one fails, so an answer that came
from a fallback is never silent on /metrics.

    pdserve_request_redrives_total{worker, reason}      an attempt given up and re-driven
    pdserve_local_prefill_fallbacks_total{worker, reason}  a disaggregated deployment's request
                                                        served whole by one worker
    pdserve_rejections_retried_total{worker}           a retryable Rejected (no room) retried

`reason` of a re-drive is the `Lost` kind (pdserve/router/routing.py): failed (the worker sent
Failed: a transfer error or a KV deadline, whose own counts are the workers'
pdserve_kv_transfer_failures_total), lost (died or disconnected), silent (a first-token or
token deadline passed), unreachable (the send failed), switching (every worker of the role is
switching roles), no_cores (the adaptive planner gave it none). `reason` of a local prefill:
no_prefill (no healthy prefill worker could take it), no_decode (the prefill worker ran it
whole: no decode worker could), resumed (tokens were already streamed, so the re-driven
request recomputes them on one worker).

The workers count their own (router/metrics.py exports them from their Stats):
pdserve_kv_transfer_fallbacks_total{worker, reason} is a prefill worker's KV connections moved
to a slower path; reason shm_to_tcp: the receiver offered shared memory that could not be
mapped, so tcp carries its KV (pdserve/transfer/sender.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter


class FallbackMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.redrives = Counter(
            "pdserve_request_redrives",
            "Attempts given up after a worker failure and re-driven, by the worker and why.",
            ["worker", "reason"],
            registry=registry,
        )
        self.local_prefills = Counter(
            "pdserve_local_prefill_fallbacks",
            "Requests of a disaggregated deployment served whole by one worker (no KV "
            "transfer) because a prefill or decode worker, or the link, failed.",
            ["worker", "reason"],
            registry=registry,
        )
        self.rejections_retried = Counter(
            "pdserve_rejections_retried",
            "Retryable refusals (no room for the request) retried elsewhere or later.",
            ["worker"],
            registry=registry,
        )

    def served_whole(self, plane: Any, worker_id: str, num_streamed: int) -> None:
        """A request's attempt runs whole on `worker_id` (Generate): a fallback when the
        deployment (`plane`, the router's ControlPlane) has prefill and decode workers."""
        roles = {w.role for w in plane.workers.values()}
        if not {"prefill", "decode"} <= roles:
            return
        role = getattr(plane.workers.get(worker_id), "role", "")
        if num_streamed:
            reason = "resumed"
        else:
            reason = "no_decode" if role == "prefill" else "no_prefill"
        self.local_prefills.labels(worker_id, reason).inc()
