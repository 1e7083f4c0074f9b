"""The P:D split: follows a chat -> summarization -> chat step change, one switch at a time,
with the minimum dwell, and never flips back while the demand holds."""

from __future__ import annotations

import pytest

from pdserve.planner.roles import RoleSplit, RoleView

CAPACITY = 1000.0  # prompt tokens/s one prefill worker carries


def views(roles: dict[str, str], switching: str = "", kv: float = 0.3) -> list[RoleView]:
    return [
        RoleView(w, r, w != switching, w == switching, kv, 0, CAPACITY)
        for w, r in sorted(roles.items())
    ]


def run_phases(phases, interval_s=1.0, min_dwell_s=10.0, switch_s=2.0):
    """Ticks every interval; a switch takes `switch_s` (the worker drains). Returns the
    switches as (time, worker, new role) and the roles at each phase's end."""
    split = RoleSplit(min_dwell_s, window_s=2 * interval_s)
    roles = {"w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"}
    switches, ends, now = [], [], 0.0
    switching: tuple[str, str, float] | None = None
    for asked_per_s, duration_s in phases:
        end = now + duration_s
        while now < end:
            now += interval_s
            split.add_demand(now, int(asked_per_s * interval_s))
            if switching and now >= switching[2]:
                roles[switching[0]] = switching[1]
                switching = None
            current = views(roles, switching[0] if switching else "")
            choice = split.choose(now, current, split.demand_tokens_per_s(now))
            if choice:
                worker, role, _ = choice
                split.switched(now, worker)
                switches.append((now, worker, role))
                switching = (worker, role, now + switch_s)
        ends.append(sorted(r for r in roles.values()).count("prefill"))
    return switches, ends


def test_follows_a_step_change_without_flip_back():
    chat, summarization = 300.0, 2500.0  # prompt tokens/s asked
    switches, ends = run_phases([(chat, 120), (summarization, 120), (chat, 120)])
    assert ends == [1, 3, 1]  # 2500 tokens/s needs 3 prefill workers of 1000
    phases = [
        [s for s in switches if lo < s[0] <= hi] for lo, hi in ((0, 120), (120, 240), (240, 360))
    ]
    assert phases[0] == []
    assert [r for _, _, r in phases[1]] == ["prefill", "prefill"]  # monotone: no flip-back
    assert [r for _, _, r in phases[2]] == ["decode", "decode"]
    times = [t for t, _, _ in switches]
    assert all(b - a >= 10.0 for a, b in zip(times, times[1:], strict=False))  # min dwell
    assert phases[1][0][0] <= 120 + 2  # the first switch within two intervals of the change


def test_steady_demand_between_the_thresholds_never_switches():
    for asked in (700.0, 1000.0, 1300.0):  # around one and two workers' capacity
        switches, _ = run_phases([(asked, 300)])
        assert len(switches) <= 1, (asked, switches)  # at most the one move up, never back


def test_nothing_switches_without_a_model_or_with_two_workers():
    split = RoleSplit(0.0, 1.0)
    no_model = [
        RoleView("w0", "prefill", True, False, 0.1, 0, None),
        *views({"w1": "decode", "w2": "decode"}),
    ]
    assert split.choose(0.0, no_model, 1e6) is None
    assert split.choose(0.0, views({"w0": "prefill", "w1": "decode"}), 1e6) is None


@pytest.mark.parametrize(("kv", "expected"), [(0.95, "decode_kv"), (0.3, None)])
def test_decode_kv_pressure_takes_a_prefill_worker_back(kv, expected):
    split = RoleSplit(0.0, 1.0)
    roles = {"w0": "prefill", "w1": "prefill", "w2": "decode"}
    choice = split.choose(0.0, views(roles, kv=kv), 800.0)  # one prefill worker would carry it
    assert (choice[2] if choice else None) == expected
