"""An adaptive deployment over fake workers: the driver prefills where the planner decides
(local on the decode worker, remote on a prefill worker once it has cores), a parked worker
is never sent work, and every request finishes while cores and roles move under it."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.decision import LOCAL, Decision
from pdserve.router import adaptive_planner as planner_module
from tests.planner.conftest import ONE_B, SMOLLM, two_cores
from tests.router.conftest import OUTPUT_TEXT
from tests.router.harness import Cluster

POOL = (0, 1, 2, 3)
# An ITL target: without one the planner keeps every prefill local (collocated's behaviour).
# The core hold at this file's time scale: at most 3 s, 3 mean gaps between remote requests.
ADAPTIVE = AdaptiveConfig(
    enabled=True,
    interval_s=0.05,
    core_dwell_s=0.3,
    min_dwell_s=0.0,
    core_hold_gaps=3.0,
    core_hold_max_s=3.0,
    fallback_prompt_tokens=64,
    slo_itl_ms=50.0,
)
LONG = "x" * 200  # 200 tokens with the byte-level test tokenizer: over the fallback's 64


def cluster(tokenizer_dir: Path, script: list[int], roles: dict[str, str], **behaviour) -> Cluster:
    per_worker = {
        w: {
            "cpus": POOL,
            "threads": len(POOL) if w == "d1" else 0,
            "core_switch_s": 0.05,
            **behaviour.get(w, {}),
        }
        for w in roles
    }
    return Cluster(tokenizer_dir, script, roles, per_worker, cpus=POOL, adaptive=ADAPTIVE)


def post(c: Cluster, prompt: str, max_tokens: int) -> requests.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    return requests.post(f"{c.url}/v1/completions", json=body, timeout=30)


def kinds_for(c: Cluster, worker_id: str) -> list[str]:
    return [k for k in c.kinds(worker_id) if k != "SetCores"]


def decisions(c: Cluster) -> dict[str, float]:
    text = requests.get(f"{c.url}/metrics", timeout=10).text
    return {
        line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_adaptive_decisions_total{")
    }


def test_idle_decode_worker_prefills_locally_with_every_core(tokenizer_dir, script):
    with cluster(tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}) as c:
        c.wait_until(lambda: "SetCores" in c.kinds("d1"))  # the planner's first layout
        r = post(c, LONG, 9)
        assert r.json()["choices"][0]["text"] == OUTPUT_TEXT[:9]
        assert kinds_for(c, "d1") == ["Generate"] and kinds_for(c, "p0") == []
        assert (c.workers["d1"].threads, c.workers["p0"].threads) == (4, 0)
        assert decisions(c) == {'kind="local",reason="idle_decode"': 1.0}


def test_remote_waits_for_cores_local_stays_and_cores_merge_back(tokenizer_dir, script):
    with cluster(tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}, d1={"step_s": 0.1}) as c:
        plane = c.app_state.plane
        with ThreadPoolExecutor(4) as pool:
            running = pool.submit(post, c, "Hi", 20)  # occupies d1 for ~2 s
            c.wait_until(lambda: (s := plane.workers["d1"].stats) and s.num_running >= 1)
            remote = pool.submit(post, c, LONG, 5)
            c.wait_until(lambda: "Prefill" in c.kinds("p0"))
            local = pool.submit(post, c, "Hey", 5)
            for future in (running, remote, local):
                r = future.result()
                assert r.status_code == 200, r.text
        assert remote.result().json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
        assert local.result().json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
        assert kinds_for(c, "p0") == ["Prefill"]
        assert kinds_for(c, "d1").count("Generate") == 2  # "Hi" and "Hey": local
        assert c.workers["p0"].parked_work == 0  # Prefill only after its CoresSet
        assert decisions(c) == {
            'kind="local",reason="idle_decode"': 1.0,
            'kind="remote",reason="fallback_long"': 1.0,
            'kind="local",reason="fallback_short"': 1.0,
        }
        # idle again: after the hold the prefill worker is parked, the decode worker whole
        c.wait_until(lambda: (c.workers["p0"].threads, c.workers["d1"].threads) == (0, 4), 5)
        status = requests.get(f"{c.url}/v1/status", timeout=10).json()["planner"]
        assert status["split"] == {"prefill": 1, "decode": 1}
        targets = status["targets"]  # the ITL as set; the stall budget derived, once fitted
        assert (targets["itl_ms"], targets["itl_source"]) == (50.0, "set")
        assert targets["max_gap_source"].startswith("derived")
        assert targets["pools"][0]["cpus"] == list(POOL)
        assert [d["reason"] for d in status["recent_decisions"]] == [
            "idle_decode",
            "fallback_long",
            "fallback_short",
        ]
        assert status["num_core_switches"] >= 3  # split, and merged back


def test_a_stream_of_remote_requests_holds_one_split_and_a_lull_merges_it(tokenizer_dir, script):
    # core_dwell_s 0.3: without the hold each remote request would split and merge back
    with cluster(
        tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}, d1={"step_s": 0.25}
    ) as c:
        plane = c.app_state.plane
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, c, "Hi", 22)  # occupies d1 for ~5 s
            c.wait_until(lambda: (s := plane.workers["d1"].stats) and s.num_running >= 1)
            switches = []
            for _ in range(4):  # one every ~0.8 s
                sent = time.monotonic()
                assert post(c, LONG, 1).status_code == 200
                switches.append(c.kinds("p0").count("SetCores"))
                time.sleep(max(0.0, 0.8 - (time.monotonic() - sent)))
            # one split, held from the first request (no rate yet: the longest hold, 3 s)
            assert switches[1] == switches[2] == switches[3], switches
            assert c.workers["p0"].threads > 0  # idle for ~0.8 s, over the dwell
            assert running.result().status_code == 200
        assert decisions(c)['kind="remote",reason="fallback_long"'] == 4.0
        # the lull: the hold (3 s: too few gaps for a rate) without a remote request merges
        c.wait_until(lambda: (c.workers["p0"].threads, c.workers["d1"].threads) == (0, 4), 10)


def test_an_slo_sized_chunk_travels_with_the_local_prefill(tokenizer_dir, script, monkeypatch):
    # The decision itself is tests/planner/test_decision.py's; here, what the driver does
    # with one: Generate carries the chunk to the decode worker, /metrics counts the reason.
    real = planner_module.decide

    def slo_chunk(situation, *args):
        d = real(situation, *args)
        if situation.num_decodes == 0:
            return d
        return Decision(LOCAL, "slo_chunk", num_prefill_tokens=200, prefill_chunk_tokens=32)

    monkeypatch.setattr(planner_module, "decide", slo_chunk)
    with cluster(
        tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}, d1={"step_s": 0.05}
    ) as c:
        plane = c.app_state.plane
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, c, "Hi", 20)
            c.wait_until(lambda: (s := plane.workers["d1"].stats) and s.num_running >= 1)
            chunked = post(c, LONG, 5)
            assert running.result().status_code == 200
        assert chunked.json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
        generates = [m for m in c.workers["d1"].received if type(m).__name__ == "Generate"]
        assert [m.prefill_chunk_tokens for m in generates] == [None, 32]
        # and the stall budget the worker holds every local prefill to (1 s: the floor)
        assert [m.stall_budget_s for m in generates] == [1.0, 1.0]
        assert kinds_for(c, "p0") == []
        assert decisions(c) == {
            'kind="local",reason="idle_decode"': 1.0,
            'kind="local",reason="slo_chunk"': 1.0,
        }
        recent = requests.get(f"{c.url}/v1/status", timeout=10).json()["planner"]
        assert [d["prefill_chunk_tokens"] for d in recent["recent_decisions"]] == [None, 32]


def test_every_request_finishes_while_cores_and_roles_move(tokenizer_dir, script):
    roles = {"p0": "prefill", "d1": "decode", "d2": "decode"}
    with cluster(
        tokenizer_dir,
        script,
        roles,
        d1={"step_s": 0.02},
        d2={"step_s": 0.02},
        p0={"prefill_s": 0.05},
    ) as c:
        overlaps: list[dict] = []
        done = threading.Event()

        def watch() -> None:  # no two workers with threads ever share a cpu
            while not done.is_set():
                running = [w for w in c.workers.values() if w.threads > 0]
                cpus = [cpu for w in running for cpu in w.cpus]
                if len(cpus) != len(set(cpus)):
                    overlaps.append({w.worker_id: list(w.cpus) for w in running})
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        prompts = [LONG if i % 3 == 0 else "Hello" for i in range(18)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(post, c, p, 12) for p in prompts]
            time.sleep(0.3)
            c.call(_switch(c, "d2", "prefill"))
            results = [f.result() for f in futures]
        done.set()
        watcher.join()
        assert [r.status_code for r in results] == [200] * len(prompts)
        assert {r.json()["choices"][0]["text"] for r in results} == {OUTPUT_TEXT[:12]}
        assert not overlaps, overlaps[:3]
        assert all(w.parked_work == 0 for w in c.workers.values())
        kinds = {key.split(",")[0] for key in decisions(c)}
        assert kinds == {'kind="local"', 'kind="remote"'}  # both paths taken
        status = requests.get(f"{c.url}/v1/status", timeout=10).json()["planner"]
        assert status["num_core_switches"] >= 2
        c.wait_until(lambda: c.app_state.plane.workers["d2"].role == "prefill")


async def _switch(c: Cluster, worker_id: str, role: str) -> bool:
    return c.app_state.plane.switch_role(worker_id, role)


def test_without_adaptive_nothing_changes(tokenizer_dir, script, caplog):
    """No planner: no SetCores, the static disaggregated path, Ready taken quietly."""
    with Cluster(tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}) as c:
        assert c.app_state.plane.planner is None
        assert post(c, LONG, 5).json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
        assert [k for _, k, _ in c.events] == ["Reserve", "Prefill", "StartDecode"]
        assert "planner" not in requests.get(f"{c.url}/v1/status", timeout=10).json()
    assert "unexpected" not in caplog.text


def test_the_prefill_workers_send_seconds_reach_the_planners_link(tokenizer_dir, script):
    """Each interval the planner takes a prefill worker's KV bytes and send seconds (its
    Stats) as a sample of the link; totals that did not move are no sample."""
    with cluster(
        tokenizer_dir,
        script,
        {"p0": "prefill", "d1": "decode"},
        p0={"cache_stats": {"kv_send_s": 0.5}},
    ) as c:

        def link() -> dict:
            status = requests.get(f"{c.url}/v1/status", timeout=10).json()
            return status["planner"]["model"]["link"]

        c.wait_until(lambda: link()["num_samples"] == 1)
        time.sleep(0.2)  # four more intervals of the same totals
        assert link() == {"bandwidth_bytes_per_s": None, "latency_s": None, "num_samples": 1}


@pytest.mark.parametrize(
    ("shape", "slo_itl_ms", "reason"),
    [(ONE_B, None, "stall_split"), (SMOLLM, 100.0, "itl_interference")],
    ids=["1b", "smollm"],
)
def test_a_split_is_made_only_where_the_decodes_step_holds_the_stall_budget(
    tokenizer_dir, script, tmp_path, shape, slo_itl_ms, reason
):
    # Two cores, the planner's model seeded at these step times (no StepReports from fake
    # workers), five decodes running. A 1B batch takes 1.8 s a step on one core: no split
    # holds the derived 1.8 s stall budget, so the long prompt prefills on the decode worker
    # beside them in chunks and the prefill worker is never given a core. SmolLM2's 8 ms
    # steps split as before: the prompt goes remote under an ITL target local breaks.
    path = tmp_path / "profile.json"
    two_cores(shape).save(path)
    adaptive = dataclasses.replace(ADAPTIVE, profile=str(path), slo_itl_ms=slo_itl_ms)
    pool = (0, 1)
    per_worker = {
        "p0": {"cpus": pool, "threads": 0, "core_switch_s": 0.05},
        "d1": {"cpus": pool, "threads": 2, "core_switch_s": 0.05, "step_s": 0.1},
    }
    roles = {"p0": "prefill", "d1": "decode"}
    with Cluster(tokenizer_dir, script, roles, per_worker, cpus=pool, adaptive=adaptive) as c:
        plane = c.app_state.plane
        with ThreadPoolExecutor(6) as executor:
            running = [executor.submit(post, c, "Hi", 20) for _ in range(5)]
            c.wait_until(lambda: (s := plane.workers["d1"].stats) and s.num_running >= 5)
            assert post(c, LONG, 5).json()["choices"][0]["text"] == OUTPUT_TEXT[:5]
            assert all(f.result().status_code == 200 for f in running)
        kind = "local" if reason == "stall_split" else "remote"
        assert decisions(c)[f'kind="{kind}",reason="{reason}"'] == 1.0
        split = [m.threads for m in c.workers["p0"].received if type(m).__name__ == "SetCores"]
        if reason == "stall_split":
            assert kinds_for(c, "p0") == [] and set(split) == {0}  # never given a core
            generates = [m for m in c.workers["d1"].received if type(m).__name__ == "Generate"]
            assert generates[-1].prefill_chunk_tokens is not None  # chunked, and guarded:
            assert generates[-1].stall_budget_s == pytest.approx(1.8)
        else:
            assert kinds_for(c, "p0") == ["Prefill"] and max(split) == 1


def test_status_and_metrics_show_the_decode_workers_guard_and_need(tokenizer_dir, script):
    guard = {"stall_budget_s": 1.8, "stall_cap_tokens": 40, "num_stall_capped_steps": 3}
    with cluster(
        tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}, d1={"cache_stats": guard}
    ) as c:
        c.wait_until(lambda: c.app_state.plane.workers["d1"].stats is not None)
        status = requests.get(f"{c.url}/v1/status", timeout=10).json()
        row = next(w for w in status["workers"] if w["worker"] == "d1")
        assert {k: row[k] for k in guard} == guard
        need = status["planner"]["decode_needs"]["d1"]  # nothing decoding: one thread
        assert need == {"threads": 1, "stall_threads": 0, "split_breaks_stall": False}
        text = requests.get(f"{c.url}/metrics", timeout=10).text
        assert 'pdserve_stall_capped_steps_total{worker="d1"} 3.0' in text


def test_a_remote_prompt_not_sent_yet_is_in_the_prefill_queue(tokenizer_dir, script, monkeypatch):
    # The second of two prompts decided remote while the first waits for the prefill
    # worker's cores (d1 gives them up at its next step boundary) is priced behind it.
    real, queued = planner_module.decide, []

    def record(situation, *args):
        if situation.num_decodes:
            queued.append(situation.prefill_queue_tokens)
        return real(situation, *args)

    monkeypatch.setattr(planner_module, "decide", record)
    with cluster(tokenizer_dir, script, {"p0": "prefill", "d1": "decode"}, d1={"step_s": 0.4}) as c:
        plane, planner = c.app_state.plane, c.app_state.plane.planner
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(post, c, "Hi", 8)  # occupies d1, 0.4 s a step
            c.wait_until(lambda: (s := plane.workers["d1"].stats) and s.num_running >= 1)
            first = pool.submit(post, c, LONG, 2)
            c.wait_until(lambda: len(queued) == 1)
            second = pool.submit(post, c, LONG, 2)
            assert all(f.result().status_code == 200 for f in (running, first, second))
        assert queued[0] == 0 and queued[1] >= 200, queued  # the first's 200 tokens
        assert kinds_for(c, "p0") == ["Prefill", "Prefill"]
        assert planner._undispatched == {}  # both sent: the router's charge counted them
