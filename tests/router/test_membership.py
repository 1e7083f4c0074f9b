"""Workers joining, moving and leaving a running router (scaling, and a worker restarted at
another address): `ControlPlane.add_worker()`, `retire()` and `remove_worker()`."""

from __future__ import annotations

from pathlib import Path

import requests

from pdserve.router.config import WorkerEndpoint
from tests.router.harness import Cluster, FakeWorker
from tests.router.test_recovery import generates


def complete(c: Cluster) -> str:
    r = requests.post(f"{c.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def join(c: Cluster, worker_id: str, address: str | None = None) -> FakeWorker:
    """A fake worker started after the router, at `address`, and told to the router."""
    worker = FakeWorker(c, worker_id, "collocated")
    worker.address = address or worker.address
    c.workers[worker_id] = worker
    plane = c.app_state.plane

    async def add() -> None:
        plane.add_worker(WorkerEndpoint(worker_id, "collocated", worker.address))

    c.call(add())
    c.start_workers_of([worker_id])
    return worker


def test_a_worker_added_at_run_time_is_served(tokenizer_dir: Path, script: list[int]) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, policy="round_robin") as c:
        plane = c.app_state.plane
        join(c, "c1")
        c.wait_until(lambda: plane.is_healthy("c1"))
        texts = {complete(c) for _ in range(4)}
        assert len(texts) == 1 and generates(c, "c1") >= 1
        assert set(plane.health()[1]["workers"]) == {"c0", "c1"}


def test_a_retired_worker_gets_nothing_new_and_is_removed(
    tokenizer_dir: Path, script: list[int]
) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated", "c1": "collocated"}) as c:
        plane = c.app_state.plane

        async def retire() -> bool:
            return plane.retire("c1")

        assert c.call(retire())  # idle: may be removed at once
        before = generates(c, "c1")
        for _ in range(3):
            complete(c)
        assert generates(c, "c1") == before and generates(c, "c0") >= 3

        async def remove() -> None:
            plane.remove_worker("c1")

        c.call(remove())
        assert set(plane.health()[1]["workers"]) == {"c0"} and plane.health()[0]
        complete(c)


def test_a_worker_back_at_another_address_is_reconnected(
    tokenizer_dir: Path, script: list[int]
) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        plane = c.app_state.plane
        epoch = plane.workers["c0"].epoch
        c.kill("c0")
        c.wait_until(lambda: not plane.is_healthy("c0"))
        join(c, "c0", address=f"ipc://{c.dir}/c0-moved")
        c.wait_until(lambda: plane.is_healthy("c0"))
        assert plane.workers["c0"].endpoint.address.endswith("c0-moved")
        assert plane.workers["c0"].epoch > epoch
        complete(c)
