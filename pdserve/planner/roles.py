"""The P:D split across workers (three or more): which worker, if any, changes role now.
Pure: callers pass the time and the views, and switch the worker themselves
(`ControlPlane.switch_role`, which drains it first).

    prefill asked / prefill capacity > PREFILL_HIGH, two or more decode workers and the
        decode KV under KV_ROOM                        -> the idlest decode worker -> prefill
    two or more prefill workers and, with one fewer, asked / capacity < PREFILL_LOW
        (or the decode KV over KV_HIGH and still < PREFILL_HIGH) -> the idlest prefill -> decode

No flip-back: a switch up needs asked > PREFILL_HIGH x capacity, and the switch back then
needs asked < PREFILL_LOW (< PREFILL_HIGH) x the capacity before the switch up, so a steady
demand cannot trigger both. One switch at a time, none while a worker is switching, none
within `min_dwell_s` of the last one, and a worker keeps a role at least `min_dwell_s`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

PREFILL_HIGH = 1.0
PREFILL_LOW = 0.6
KV_ROOM = 0.6
KV_HIGH = 0.85


@dataclass(frozen=True)
class RoleView:
    worker_id: str
    role: str
    routable: bool  # healthy and not switching
    switching: bool
    kv_occupancy: float  # blocks in use / blocks
    num_active: int  # requests the router has on it
    prefill_tokens_per_s: float | None  # what it carries as a prefill worker (None: no model)


class RoleSplit:
    def __init__(self, min_dwell_s: float, window_s: float) -> None:
        self.min_dwell_s = min_dwell_s
        self.window_s = window_s
        self.last_switch: dict[str, float] = {}  # worker -> when it last changed role
        self.last_any = float("-inf")
        self.num_switches = 0
        self._asked: collections.deque[tuple[float, int]] = collections.deque()

    def add_demand(self, now: float, num_tokens: int) -> None:
        """Prompt tokens a request asks of the prefill workers."""
        self._asked.append((now, num_tokens))

    def demand_tokens_per_s(self, now: float) -> float:
        while self._asked and now - self._asked[0][0] > self.window_s:
            self._asked.popleft()
        return sum(n for _, n in self._asked) / self.window_s

    def choose(
        self, now: float, views: Sequence[RoleView], asked_per_s: float
    ) -> tuple[str, str, str] | None:
        """(worker, new role, reason) or None."""
        if len(views) < 3 or any(v.switching for v in views):
            return None
        if now - self.last_any < self.min_dwell_s:
            return None
        prefill = [v for v in views if v.role == "prefill" and v.routable]
        decode = [v for v in views if v.role == "decode" and v.routable]
        capacities = [v.prefill_tokens_per_s for v in prefill]
        if not prefill or not decode or any(c is None or c <= 0 for c in capacities):
            return None
        capacity = sum(c for c in capacities if c is not None)
        kv = max(v.kv_occupancy for v in decode)
        if asked_per_s > PREFILL_HIGH * capacity and len(decode) >= 2 and kv < KV_ROOM:
            worker = self._idlest(decode, now)
            return (worker, "prefill", "prefill_demand") if worker else None
        if len(prefill) >= 2:
            fewer = capacity - min(c for c in capacities if c is not None)
            if asked_per_s < PREFILL_LOW * fewer:
                reason = "prefill_idle"
            elif kv > KV_HIGH and asked_per_s < PREFILL_HIGH * fewer:
                reason = "decode_kv"
            else:
                return None
            worker = self._idlest(prefill, now)
            return (worker, "decode", reason) if worker else None
        return None

    def switched(self, now: float, worker_id: str) -> None:
        self.last_switch[worker_id] = self.last_any = now
        self.num_switches += 1

    def _idlest(self, views: Sequence[RoleView], now: float) -> str | None:
        eligible = [
            v
            for v in views
            if now - self.last_switch.get(v.worker_id, float("-inf")) >= self.min_dwell_s
        ]
        if not eligible:
            return None
        return min(eligible, key=lambda v: (v.num_active, v.worker_id)).worker_id
