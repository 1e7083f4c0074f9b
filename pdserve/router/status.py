"""The cluster at a glance: `GET /v1/status` (JSON) and the `/dashboard` page that polls it
(docs/observability.md describes every field).

`History` is a ring buffer of per-interval points, so memory is bounded whatever the uptime.
Worker counters are cumulative (Stats): a point holds their difference from the previous
point, and a worker that restarted (its counter went down) counts from zero.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from pdserve import messages
from pdserve.router.completions import STATE
from pdserve.router.metrics import Window

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
# A worker's row shows its last Stats but these (before its first Stats: all zero).
_ROW_STATS = [
    f.name
    for f in dataclasses.fields(messages.Stats)
    if f.name not in ("worker_id", "role", "num_queued_prefill_tokens")
]
PERCENTILES = (50, 90, 99)


def worker_rows(state: Any) -> list[dict[str, Any]]:
    """One row per configured worker: its table entry and last Stats, flat (what /metrics
    exports and /v1/status shows)."""
    plane = state.plane
    rows = []
    for w in plane.workers.values():
        stats = w.stats or messages.Stats(w.worker_id, w.role, 0, 0, 0, 0, 0)
        cores = plane.planner.cores_of(w.worker_id) if plane.planner else None
        cpus, threads = cores or ((list(w.ready.cpus), w.ready.threads) if w.ready else ([], 0))
        rows.append(
            {
                "worker": w.worker_id,
                "role": w.role,
                "ready": w.ready is not None,
                "healthy": int(plane.is_healthy(w.worker_id)),
                "cpus": cpus,
                "threads": threads,
                "active_requests": w.active_requests,
                **{name: getattr(stats, name) for name in _ROW_STATS},
                "unacked_releases": sum(k[0] == w.worker_id for k in plane.unacked_releases),
                "kv_blocks_used": stats.num_total_blocks - stats.num_free_blocks,
            }
        )
    return rows


def percentiles(values: list[float]) -> list[float] | None:
    """Nearest-rank p50, p90, p99; None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[min(last, int(p / 100 * len(ordered)))] for p in PERCENTILES]


class History:
    """Per-interval points in a ring buffer (see the module docstring)."""

    def __init__(
        self, interval_s: float = 1.0, num_points: int = 600, num_recent: int = 10
    ) -> None:
        self.interval_s = interval_s
        self.points: collections.deque[dict[str, Any]] = collections.deque(maxlen=num_points)
        # The last intervals' samples, whole: percentiles over several intervals (`recent`).
        self.windows: collections.deque[Window] = collections.deque(maxlen=num_recent)
        self._last_rows: dict[str, dict[str, Any]] = {}
        self._last_t: float | None = None

    def add(self, t: float, window: Window, rows: list[dict[str, Any]], num_pending: int) -> None:
        # The first point, or a wall clock set back: one nominal interval.
        last_t = self._last_t if self._last_t is not None else t
        elapsed_s = t - last_t if t > last_t else self.interval_s
        self._last_t = t
        window.elapsed_s = elapsed_s
        self.windows.append(window)
        hits: dict[str, dict[str, int]] = {}
        transfer_bytes = 0
        for row in rows:
            last = self._last_rows.get(row["worker"], row)  # first seen: its baseline
            transfer_bytes += _delta(row["kv_bytes_sent"], last.get("kv_bytes_sent", 0))
            last_tiers = last.get("kv_tiers", {})
            for tier, counts in row["kv_tiers"].items():
                total = hits.setdefault(tier, {"hits": 0, "lookups": 0})
                for key in total:
                    total[key] += _delta(counts.get(key, 0), last_tiers.get(tier, {}).get(key, 0))
        self._last_rows = {row["worker"]: row for row in rows}
        parts = window.ttft_parts_s
        self.points.append(
            {
                "t": round(t, 3),
                "num_finished": window.num_finished,
                "requests_per_s": window.num_finished / elapsed_s,
                "output_tokens_per_s": window.num_output_tokens / elapsed_s,
                **{name: percentiles(window.samples.get(name, [])) for name in _LATENCIES},
                "num_pending": num_pending,
                "workers": {
                    row["worker"]: {
                        "num_waiting": row["num_waiting"],
                        "num_running": row["num_running"],
                        "kv_blocks_used": row["num_total_blocks"] - row["num_free_blocks"],
                        "threads": row["threads"],
                    }
                    for row in rows
                },
                "cache": dict(sorted(hits.items())),
                "transfer_bytes_per_s": transfer_bytes / elapsed_s,
                "ttft_parts_s": {p: s / window.num_with_parts for p, s in parts.items()},
            }
        )

    def since(self, t: float) -> list[dict[str, Any]]:
        return [p for p in self.points if p["t"] > t]

    def recent(self) -> dict[str, Any]:
        """Rates and latency percentiles over the last few intervals together."""
        elapsed_s = sum(w.elapsed_s for w in self.windows) or self.interval_s
        points = list(self.points)[-len(self.windows) :] if self.windows else []
        cache: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for point in points:
            for tier, counts in point["cache"].items():
                cache[tier].update(counts)
        return {
            "window_s": round(elapsed_s, 3),
            "requests_per_s": sum(w.num_finished for w in self.windows) / elapsed_s,
            "output_tokens_per_s": sum(w.num_output_tokens for w in self.windows) / elapsed_s,
            **{
                name: percentiles([v for w in self.windows for v in w.samples.get(name, [])])
                for name in _LATENCIES
            },
            "cache": dict(sorted(cache.items())),
        }


_LATENCIES = ("ttft_s", "tpot_s", "itl_s")


def _delta(now: int, before: int) -> int:
    return now - before if now >= before else now  # a restarted worker counts from zero


HISTORY = web.AppKey("status_history", History)


def status(state: Any, history: History, since: float = 0.0) -> dict[str, Any]:
    ok, health = state.plane.health()
    out = {
        "model": state.config.model,
        "time": time.time(),
        "interval_s": history.interval_s,
        "health": {"ok": ok, "missing_roles": health["missing_roles"]},
        "num_pending": state.num_pending,
        "requests": dict(sorted(state.metrics.requests.items())),
        "workers": worker_rows(state),
        "recent": history.recent(),
        "history": history.since(since),
    }
    if state.plane.planner is not None:
        out["planner"] = state.plane.planner.status()
    return out


async def status_route(request: web.Request) -> web.Response:
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise web.HTTPBadRequest(reason="since must be a number (unix seconds)") from None
    return web.json_response(status(request.app[STATE], request.app[HISTORY], since))


_ASSET_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def add_routes(app: web.Application, history: History) -> None:
    """The status route, the page and the sampler that fills `history` (one point per
    interval, until the app stops)."""
    app[HISTORY] = history

    async def sample_forever() -> None:
        state = app[STATE]
        while True:
            await asyncio.sleep(history.interval_s)
            window, rows = state.metrics.window.take(), worker_rows(state)
            history.add(time.time(), window, rows, state.num_pending)

    async def sampler(_: web.Application):  # a cleanup context
        task = asyncio.create_task(sample_forever())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(sampler)
    # The page's files (about 60 KB), read once: a request never touches the disk.
    files = [p for p in DASHBOARD_DIR.iterdir() if p.suffix in _ASSET_TYPES]
    assets = {p.name: (p.read_bytes(), _ASSET_TYPES[p.suffix]) for p in files}

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        if name not in assets:
            raise web.HTTPNotFound()
        body, content_type = assets[name]
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    app.router.add_get("/v1/status", status_route)
    app.router.add_get("/dashboard", asset)
    app.router.add_get("/dashboard/{name}", asset)
