"""`pdserve status URL`: the cluster at a glance in a terminal, from the router's /v1/status.

Once by default; `--watch S` redraws every S seconds until Ctrl-C. A router that cannot be
reached, or a URL that does not answer like one, is one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

EXIT_UNREACHABLE = 1
_CLEAR = "\x1b[H\x1b[2J"


class StatusError(Exception):
    pass


def add_status_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="the cluster at a glance (a router's /v1/status)")
    p.add_argument("url", help="the router, e.g. http://127.0.0.1:8000")
    p.add_argument("--watch", type=float, default=None, metavar="S", help="refresh every S s")
    p.add_argument("--api-key", default=None, help="when the router protects /v1/status")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    p.set_defaults(func=cmd_status)


def fetch(url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    try:
        request = urllib.request.Request(url.rstrip("/") + "/v1/status")
    except ValueError:
        raise StatusError(f"not a URL: {url!r} (e.g. http://127.0.0.1:8000)") from None
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url} answered HTTP {exc.code} for /v1/status") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach a router at {url}: {reason}") from None
    except ValueError:
        raise StatusError(f"{url} is not a pdserve router (/v1/status is not JSON)") from None
    if not isinstance(body, dict) or "workers" not in body:
        raise StatusError(f"{url} is not a pdserve router (no workers in /v1/status)")
    return body


def render(status: dict[str, Any], url: str) -> str:
    health = status["health"]
    missing = ", ".join(health["missing_roles"])
    state = "healthy" if health["ok"] else f"UNAVAILABLE, missing {missing}"
    lines = [f"{url}  {status['model']}  {state}  {status['num_pending']} in flight", ""]
    header = (
        "worker",
        "role",
        "cores",
        "thr",
        "health",
        "wait",
        "run",
        "KV used",
        "L1 hit",
        "KV sent",
        "KV recv",
    )
    rows = [header]
    for w in status["workers"]:
        total = w["num_total_blocks"]
        used = w["kv_blocks_used"]
        kv = f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"
        l1 = w["kv_tiers"].get("L1", {})
        rows.append(
            (
                w["worker"],
                w["role"],
                _cores(w["cpus"]),
                str(w["threads"] or "-"),
                "healthy" if w["healthy"] else ("starting" if not w["ready"] else "DOWN"),
                str(w["num_waiting"]),
                str(w["num_running"]),
                kv,
                _rate(l1.get("hits", 0), l1.get("lookups", 0)),
                _bytes(w["kv_bytes_sent"]),
                _bytes(w["kv_bytes_received"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows]
    recent = status["recent"]
    lines += [
        "",
        f"last {recent['window_s']:.0f} s: {recent['requests_per_s']:.2f} req/s, "
        f"{recent['output_tokens_per_s']:.1f} output tok/s",
    ]
    for name, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL")):
        pct = recent[name]
        values = "  ".join(f"p{p} {v * 1000:.1f} ms" for p, v in zip((50, 90, 99), pct or []))
        values = values or "-"
        lines.append(f"  {label:5} {values}")
    hits = [f"{t} {_rate(c['hits'], c['lookups'])}" for t, c in recent["cache"].items()]
    lines.append("  cache hit  " + ("  ".join(hits) or "-"))
    done = ", ".join(f"{k} {v}" for k, v in status["requests"].items())
    lines.append(f"requests since start: {done or 'none'}")
    return "\n".join(lines)


def _cores(cpus: list[int]) -> str:
    if not cpus:
        return "any"
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 2:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def _rate(hits: int, lookups: int) -> str:
    return f"{100 * hits / lookups:.1f}%" if lookups else "-"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def cmd_status(args: argparse.Namespace) -> int:
    try:
        while True:
            text = render(fetch(args.url, args.api_key, args.timeout), args.url)
            if args.watch is None:
                print(text)
                return 0
            print(_CLEAR + text, flush=True)
            time.sleep(args.watch)
    except StatusError as exc:
        print(f"pdserve status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
