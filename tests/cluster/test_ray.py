"""Ray placement on a real two-node Ray cluster on this machine (two raylets, each with its
own custom resource, so a role's `ray_resources` picks the node): disaggregated output equals
collocated with prefill and decode on different nodes (shm, which they share), a killed worker
actor comes back and its requests finish, scaling adds and removes actors, and nothing is left
running after shutdown. One module-scoped Ray cluster keeps CI time bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
from pathlib import Path

import pytest
import requests

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pdserve[ray]'")

from pdserve.cluster.config import Pipeline  # noqa: E402
from pdserve.cluster.launcher import ClusterError, free_port  # noqa: E402
from pdserve.cluster.ray import RayCluster, _check_auto  # noqa: E402
from pdserve.transfer import KVTransferConfig  # noqa: E402
from tests.cluster.conftest import get_text, post, role  # noqa: E402
from tests.cluster.test_cluster import complete_all  # noqa: E402

pytestmark = pytest.mark.slow
try:  # the state API (what the dashboard shows) comes with ray[default]
    import aiohttp_cors  # noqa: F401

    HAS_STATE_API = True
except ImportError:
    HAS_STATE_API = False


@pytest.fixture(scope="module")
def ray_nodes():
    from ray.cluster_utils import Cluster as RayTestCluster

    nodes = RayTestCluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"prefill_pool": 4},
            "include_dashboard": HAS_STATE_API,
            "dashboard_port": free_port(),
        },
    )
    nodes.add_node(num_cpus=2, resources={"decode_pool": 4})
    ray.init(address=nodes.address, logging_level="WARNING")
    nodes.wait_for_nodes()
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def start(model, **pipeline) -> RayCluster:
    return RayCluster(
        Pipeline(model=str(model), port=free_port(), placement="ray", **pipeline),
        log_level="WARNING",
    )


def pools(**kw) -> dict:
    """Prefill on the head node, decode on the second (their custom resources)."""
    return {
        "prefill": role(ray_resources={"prefill_pool": 1}, **kw),
        "decode": role(ray_resources={"decode_pool": 1}),
    }


def actor_pids() -> set[int]:
    """pdserve's actor processes still alive (Ray titles them `ray::<class>`)."""
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"ray::WorkerActor" in title or b"ray::RouterActor" in title:
            pids.add(int(proc.name))
    return pids


def received_bytes(url: str) -> int:
    """KV bytes decode-0 received over tcp (shm writes land without frames)."""
    for line in get_text(url, "/metrics").splitlines():
        if (
            line.startswith("pdserve_kv_transfer_bytes_total")
            and "received" in line
            and ('"decode-0"' in line)
        ):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def health(url: str) -> dict:
    """/health's body, also when it is 503 (a role has no healthy worker)."""
    try:
        return json.loads(get_text(url, "/health"))
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def stream_texts(url: str, body: dict, after_five) -> list[str]:
    """A streamed completion's text chunks; `after_five()` runs once 5 have arrived."""
    r = requests.post(
        url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120
    )
    texts = []
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if len(texts) == 5:
                after_five()
    return texts


def wait_for(predicate, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def reference(ray_nodes, tiny_served_model):
    with start(tiny_served_model, collocated=role(ray_resources={"prefill_pool": 1})) as url:
        return complete_all(url, str(tiny_served_model))


def test_1p1d_on_two_nodes_equals_collocated(ray_nodes, tiny_served_model, reference):
    cluster = start(tiny_served_model, kv_transfer=KVTransferConfig(backend="auto"), **pools())
    with cluster as url:
        nodes = {w: p["node_id"] for w, p in cluster.placements.items()}
        assert nodes["prefill-0"] != nodes["decode-0"]
        assert complete_all(url, str(tiny_served_model)) == reference
        # Two nodes of one machine share /dev/shm: `auto` sees the decode worker's segment and
        # writes through it (no frames), whatever the Ray node (test_ray_netns.py: tcp where
        # a node has its own /dev/shm). Stats come with the heartbeat: a few beats' time.
        assert not wait_for(lambda: received_bytes(url) > 0, timeout_s=2)
    assert wait_for(lambda: not actor_pids())  # ray.kill ends processes asynchronously


def test_same_node_uses_shm(ray_nodes, tiny_served_model, reference):
    both = role(ray_resources={"decode_pool": 1})
    cluster = start(tiny_served_model, prefill=both, decode=both)
    with cluster as url:
        assert (
            cluster.placements["prefill-0"]["node_id"] == cluster.placements["decode-0"]["node_id"]
        )
        assert complete_all(url, str(tiny_served_model)) == reference
        # Stats arrive with the heartbeat: give it a few beats to report any tcp bytes.
        assert not wait_for(lambda: received_bytes(url) > 0, timeout_s=2)


def test_killed_worker_is_restarted_and_requests_finish(ray_nodes, tiny_served_model):
    cluster = start(tiny_served_model, **pools())
    model = str(tiny_served_model)
    body = {
        "model": model,
        "prompt": [50] * 20,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    }
    with cluster as url:
        expected = post(url, "/v1/completions", body)["choices"][0]["text"]
        old_pid = int(cluster.placements["decode-0"]["pid"])
        # after 5 streamed tokens the request is decoding on decode-0 (the only decode worker)
        texts = stream_texts(url, body, lambda: os.kill(old_pid, signal.SIGKILL))
        assert len(texts) > 5 and "".join(texts) == expected

        # Ray restarted the actor in a new process, which the router serves again.
        def back() -> bool:
            try:
                pid = int(ray.get(cluster.workers["decode-0"].placed.remote(), timeout=5)["pid"])
            except ray.exceptions.RayError:  # still restarting
                return False
            return pid != old_pid and health(url)["workers"]["decode-0"]["healthy"]

        assert wait_for(back, timeout_s=60), "decode-0 did not come back"
        assert post(url, "/v1/completions", body)["choices"][0]["text"] == expected
    assert wait_for(lambda: not actor_pids())  # ray.kill ends processes asynchronously


def test_killed_router_is_restarted_and_finds_its_workers(ray_nodes, tiny_served_model):
    cluster = start(tiny_served_model, **pools())
    body = {
        "model": str(tiny_served_model),
        "prompt": [60] * 30,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    with cluster as url:
        expected = post(url, "/v1/completions", body)["choices"][0]["text"]
        old_pid = int(ray.get(cluster.router.address.remote())["pid"])
        os.kill(old_pid, signal.SIGKILL)
        cluster.check_alive()  # restarting is not an error

        def serving() -> bool:
            try:
                return health(url)["status"] == "ok"
            except OSError:  # nothing listens yet
                return False

        assert wait_for(serving, timeout_s=90), "the router did not come back"
        assert int(ray.get(cluster.router.address.remote())["pid"]) != old_pid
        assert post(url, "/v1/completions", body)["choices"][0]["text"] == expected
    assert wait_for(lambda: not actor_pids())


def test_scaling_adds_and_removes_a_worker(ray_nodes, tiny_served_model, reference):
    cluster = start(tiny_served_model, **pools())
    with cluster as url:
        assert cluster.add_worker("decode") == "decode-1"
        assert health(url)["workers"]["decode-1"]["healthy"]
        assert complete_all(url, str(tiny_served_model)) == reference
        assert cluster.remove_worker("decode") == "decode-1"
        assert "decode-1" not in health(url)["workers"]
        with pytest.raises(ValueError, match="keeps at least one"):
            cluster.remove_worker("decode")
        assert complete_all(url, str(tiny_served_model)) == reference
    assert wait_for(lambda: not actor_pids())  # ray.kill ends processes asynchronously


def test_unsatisfiable_resources_end_the_start(ray_nodes, tiny_served_model):
    prefill = role(ray_resources={"gpu_pool": 1})
    cluster = start(tiny_served_model, prefill=prefill, decode=role(), ray_timeout_s=3)
    t = time.monotonic()
    with pytest.raises(ClusterError, match=r"prefill-0 within 3 s .*gpu_pool"):
        cluster.__enter__()
    assert time.monotonic() - t < 30
    assert wait_for(lambda: not actor_pids())  # ray.kill ends processes asynchronously


def test_unreachable_address_errors_within_the_bound(tiny_served_model):
    port = free_port()  # nothing listens there
    cluster = RayCluster(
        Pipeline(
            model=str(tiny_served_model),
            prefill=role(),
            decode=role(),
            placement="ray",
            ray_address=f"127.0.0.1:{port}",
            ray_timeout_s=2,
        )
    )
    t = time.monotonic()
    with pytest.raises(ClusterError, match=f"cannot reach Ray at 127.0.0.1:{port}"):
        cluster.start()
    assert time.monotonic() - t < 10


def test_auto_refuses_a_cluster_chosen_by_chance():
    """Ray's address file gone (another cluster's stop removed it) and two clusters on the
    host: `auto` would join either; a file naming a stopped cluster: it would wait for it."""
    two = {"10.0.0.1:6379", "10.0.0.2:6379"}
    with pytest.raises(ClusterError, match="absent .* runs 2 Ray clusters"):
        _check_auto("/tmp/ray/ray_current_cluster", None, two, 1.0)
    _check_auto("/tmp/ray/ray_current_cluster", None, {"10.0.0.1:6379"}, 1.0)  # the only one
    gone = f"127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(ClusterError, match=f"names {gone}, cannot reach"):
        _check_auto("/tmp/ray/ray_current_cluster", gone, two, 1.0)
    assert time.monotonic() - t < 5
    with socket.create_server(("127.0.0.1", 0)) as live:
        recorded = f"127.0.0.1:{live.getsockname()[1]}"
        _check_auto("/tmp/ray/ray_current_cluster", recorded, two, 1.0)  # Ray joins that one


@pytest.mark.skipif(not HAS_STATE_API, reason="Ray's state API needs ray[default]")
def test_secret_shows_nowhere(ray_nodes, tiny_served_model):
    """Neither Ray's state API (what the dashboard shows) nor an actor process's command line
    or environment (what `ps e` shows) holds the cluster secret or the API key."""
    from ray.util.state import list_actors, list_tasks

    cluster = start(tiny_served_model, collocated=role(), api_key="sk-test-key-123")
    with cluster:
        secret = ray.get(cluster._secret_refs[0])["secret"].hex()
        shown = json.dumps([*list_actors(detail=True), *list_tasks(detail=True)], default=str)
        assert "WorkerActor" in shown
        for pid in actor_pids():
            proc = Path(f"/proc/{pid}")
            shown += (proc / "cmdline").read_bytes().decode(errors="replace")
            shown += (proc / "environ").read_bytes().decode(errors="replace")
        assert secret not in shown and "sk-test-key-123" not in shown


def test_lost_node_its_worker_comes_back_on_another(ray_nodes, tiny_served_model):
    """Last in the module: it adds two nodes and removes one. The decode worker's node is
    lost mid-stream; the stream finishes, and Ray restarts the worker on the other node, at a
    new address the router moves to."""
    first, second = (ray_nodes.add_node(num_cpus=2, resources={"lost_pool": 1}) for _ in "ab")
    ray_nodes.wait_for_nodes()
    prefill = role(ray_resources={"prefill_pool": 1})
    cluster = start(tiny_served_model, prefill=prefill, decode=role(ray_resources={"lost_pool": 1}))
    body = {
        "model": str(tiny_served_model),
        "prompt": [70] * 20,
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
    }
    with cluster as url:
        expected = post(url, "/v1/completions", body)["choices"][0]["text"]
        old = cluster.placements["decode-0"]
        lost = next(n for n in (first, second) if n.node_id == old["node_id"])
        texts = stream_texts(url, body, lambda: ray_nodes.remove_node(lost, allow_graceful=False))
        assert "".join(texts) == expected

        def moved() -> bool:
            try:
                placed = ray.get(cluster.workers["decode-0"].placed.remote(), timeout=5)
            except ray.exceptions.RayError:  # still restarting
                return False
            back = health(url)["workers"]["decode-0"]["healthy"]
            return placed["node_id"] != old["node_id"] and back

        assert wait_for(moved, timeout_s=90), "decode-0 did not come back on the other node"
        assert post(url, "/v1/completions", body)["choices"][0]["text"] == expected
    assert wait_for(lambda: not actor_pids())
