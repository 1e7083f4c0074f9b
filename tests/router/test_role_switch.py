"""Role switches at run time on real worker processes behind an in-process router: two
collocated workers become a prefill and a decode worker while requests keep coming; every
request succeeds and its greedy output is the one before any switch."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.envs import CLUSTER_SECRET as SECRET_ENV
from pdserve.workers.spec import WorkerSpec
from tests.router.harness import SECRET, Cluster

KV_BYTES = 256 * 16 * 512  # 256 blocks of 16 tokens


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(40, 120) for _ in range(n)] for n in (7, 20, 45, 70)]


def complete(url: str, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def spawn_workers(c: Cluster, model: Path) -> list[subprocess.Popen]:
    engine = EngineConfig(
        model=str(model),
        cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        scheduler=SchedulerConfig(long_prefill_token_threshold=32),  # chunked prefills
        device=DeviceConfig(threads=1),
    )
    env = {**os.environ, SECRET_ENV: SECRET.hex()}
    procs = []
    for w in c.workers.values():
        spec = WorkerSpec(w.worker_id, w.role, engine, w.address, c.router_address)
        args = [sys.executable, "-m", "pdserve.workers.main", "--spec", spec.to_json()]
        procs.append(subprocess.Popen(args, env=env))
    return procs


def switch(c: Cluster, worker_id: str, role: str) -> int:
    """Switch a worker's role; returns how many requests it held when asked."""
    plane = c.app_state.plane

    async def ask() -> tuple[bool, int]:
        return plane.switch_role(worker_id, role), plane.workers[worker_id].active_requests

    asked, num_active = c.call(ask())
    assert asked
    c.wait_until(lambda: plane.workers[worker_id].switching_to is None, timeout=60)
    assert plane.workers[worker_id].role == role
    return num_active


def test_collocated_workers_switch_to_prefill_and_decode_under_load(tiny_served_model):
    roles = {"w0": "collocated", "w1": "collocated"}
    with Cluster(tiny_served_model, [], roles, start_workers=False) as c:
        procs = spawn_workers(c, tiny_served_model)
        try:
            plane = c.app_state.plane
            c.wait_until(lambda: all(plane.is_healthy(w) for w in roles), timeout=120)
            expected = [complete(c.url, p) for p in prompts()]
            outputs: list[tuple[int, str]] = []
            stop = threading.Event()

            def load(i: int) -> None:  # requests all through the switches, 3 at a time
                while not stop.is_set():
                    outputs.append((i % 4, complete(c.url, prompts()[i % 4])))
                    i += 1

            threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
            busy = lambda w: plane.workers[w].active_requests > 0  # noqa: E731
            try:
                c.wait_until(lambda: busy("w1"), timeout=30)  # asked while holding requests
                held = switch(c, "w1", "prefill")
                c.wait_until(lambda: busy("w0"), timeout=30)
                held += switch(c, "w0", "decode")
                time.sleep(0.5)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(60)
            assert held > 0  # some requests were drained, not cut
            assert outputs and all(text == expected[i] for i, text in outputs)
            # Now disaggregated: the prefill worker sends the KV the decode worker receives.
            assert [complete(c.url, p) for p in prompts()] == expected
            stats = plane.workers
            c.wait_until(lambda: stats["w1"].stats and stats["w1"].stats.kv_bytes_sent > 0)
            assert stats["w0"].stats.role == "decode" and stats["w0"].epoch == 1
            # And back: the prefill worker becomes collocated again.
            switch(c, "w1", "collocated")
            assert [complete(c.url, p) for p in prompts()] == expected
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)


def test_a_switching_worker_is_not_routed_to_and_keeps_its_epoch(tokenizer_dir, script):
    roles = {"c0": "collocated", "c1": "collocated"}
    behaviour = {"c1": {"switch_s": 1.0}}
    with Cluster(tokenizer_dir, script, roles, behaviour, policy="round_robin") as c:
        plane = c.app_state.plane
        epoch = plane.workers["c1"].epoch

        async def ask(role: str) -> bool:
            return plane.switch_role("c1", role)

        with pytest.raises(ValueError, match="role must be one of"):
            c.call(ask("router"))
        assert c.call(ask("prefill"))
        assert not c.call(ask("decode"))  # one switch at a time
        body = {"prompt": "Hi", "max_tokens": 3}
        for _ in range(4):  # round robin, but c1 is draining: all on c0
            assert requests.post(f"{c.url}/v1/completions", json=body).status_code == 200
        assert "Generate" not in c.kinds("c1") and c.kinds("c0").count("Generate") == 4
        assert plane.healthy_roles() == {"collocated"}
        c.wait_until(lambda: plane.workers["c1"].role == "prefill")
        assert plane.workers["c1"].switching_to is None and plane.workers["c1"].epoch == epoch
        assert plane.healthy_roles() == {"collocated", "prefill"}
