"""Ray placement across hosts: a Ray head on the bridge of namespace hosts
(pdserve/testing/netns.py) and a Ray node inside each host, with its own address and its own
/dev/shm (pdserve/testing/ray_nodes.py). Prefill runs on one host, decode on the other, the
router on the head: each worker must advertise its host's address, `auto` must send the KV
over tcp because the decode worker's segment is not seen (not because a Ray node differs, and
not by trying shm and falling back), and the tokens must equal a collocated run. One Ray
cluster for the module keeps the time bounded; leaving it, also on a failure, stops every
process of the cluster and deletes the namespaces."""

from __future__ import annotations

import secrets

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'pdserve[ray]'")

from pdserve.cluster.config import Pipeline  # noqa: E402
from pdserve.cluster.launcher import free_port  # noqa: E402
from pdserve.cluster.ray import RayCluster  # noqa: E402
from pdserve.testing import ray_nodes  # noqa: E402
from pdserve.testing.netns import Hosts  # noqa: E402
from pdserve.testing.ray_nodes import RayNodes  # noqa: E402
from pdserve.transfer import KVTransferConfig  # noqa: E402
from tests.cluster.conftest import role  # noqa: E402
from tests.cluster.test_cluster import complete_all  # noqa: E402
from tests.cluster.test_hosts import counted  # noqa: E402
from tests.cluster.test_ray import wait_for  # noqa: E402

WHY_NOT = ray_nodes.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "available")]
HEAD = {"host_head": 1}


@pytest.fixture(scope="module")
def cluster_hosts(tmp_path_factory):
    # A token where Ray looks for one, as a new local ray.init() leaves in ~/.ray: a head
    # then turns token authentication on unless told, and a node joining it did not.
    token = tmp_path_factory.mktemp("ray") / "auth_token"
    token.write_text(secrets.token_hex(32))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        with Hosts(["prefill", "decode"], prefix="pdray") as hosts:
            with RayNodes(hosts, head_resources=HEAD) as nodes:
                ray.init(address=nodes.address, logging_level="WARNING")
                try:
                    yield hosts, nodes
                finally:
                    ray.shutdown()
            assert not nodes.pids(), "Ray processes outlived the cluster"


def start(model, **pipeline) -> RayCluster:
    pipeline = Pipeline(model=str(model), port=free_port(), placement="ray", **pipeline)
    return RayCluster(pipeline, log_level="WARNING")


def test_1p1d_on_two_namespace_nodes_uses_tcp_and_equals_collocated(
    cluster_hosts, tiny_served_model
):
    hosts, nodes = cluster_hosts
    model = str(tiny_served_model)
    with start(model, collocated=role(ray_resources=HEAD)) as url:
        reference = complete_all(url, model)
    split = start(
        model,
        kv_transfer=KVTransferConfig(backend="auto"),
        prefill=role(ray_resources={nodes.resource("prefill"): 1}),
        decode=role(ray_resources={nodes.resource("decode"): 1}),
    )
    with split as url:
        for worker_id, name in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert split.placements[worker_id]["node_ip"] == hosts.ip(name)
        assert complete_all(url, model) == reference
        # Frames received (shm writes send none; stats come with the heartbeat), and tcp was
        # chosen up front: no connection tried shm and fell back.
        received = {"worker": "decode-0", "direction": "received"}
        assert wait_for(lambda: counted(url, "pdserve_kv_transfer_bytes_total", **received) > 0)
        assert counted(url, "pdserve_kv_transfer_fallbacks_total", worker="prefill-0") == 0
