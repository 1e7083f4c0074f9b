"""The deployment recipes in deploy/: every Kubernetes manifest is valid against the Kubernetes
schema (kubernetes-validate's bundled schemas, offline), the configs they hand pdserve parse
as pdserve's own (after the kubelet's $(VAR) expansion), the router's worker list names the
StatefulSets' pods, and the Slurm script is valid bash (and clean under shellcheck, if any)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.router.config import RouterConfig
from pdserve.schema import from_dict
from pdserve.workers.spec import WorkerSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


def container_args(doc: dict) -> list[str]:
    return doc["spec"]["template"]["spec"]["containers"][0]["args"]


def expand(text: str, pod_name: str) -> str:
    """What the kubelet does to $(VAR) in args."""
    return text.replace("$(POD_NAME)", pod_name).replace("$(POD_IP)", "10.0.0.7")


def test_every_manifest_is_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    assert MANIFESTS
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)  # raises naming the field


def test_router_and_worker_configs_parse_and_match():
    (router,) = by_kind("Deployment")
    config = from_dict(RouterConfig, json.loads(container_args(router)[1]), "router.yaml")
    workers = {w.worker_id: w for w in config.workers}
    pods = set()
    for sts in by_kind("StatefulSet"):
        name = sts["metadata"]["name"]
        for i in range(sts["spec"]["replicas"]):
            pod = f"{name}-{i}"
            spec = WorkerSpec.from_json(expand(container_args(sts)[1], pod))
            assert spec.worker_id == pod and spec.transfer_host == "10.0.0.7"
            assert workers[pod].role == spec.role
            # the router connects to the pod's stable DNS name (its StatefulSet's Service)
            assert workers[pod].address == f"tcp://{pod}.{sts['spec']['serviceName']}:5601"
            pods.add(pod)
    assert pods == set(workers)


def test_secrets_come_from_the_secret_never_from_args():
    (secret,) = by_kind("Secret")
    keys = set(secret["stringData"])
    # A placeholder left in place fails loudly (not hex), never serves with a known secret.
    assert not re.fullmatch(r"[0-9a-f]+", secret["stringData"]["cluster-secret"])
    for doc in [*by_kind("Deployment"), *by_kind("StatefulSet")]:
        container = doc["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
        assert env["PDSERVE_CLUSTER_SECRET"] == {"name": "pdserve", "key": "cluster-secret"}
        assert {ref["key"] for ref in env.values() if ref} <= keys
        assert "secret" not in " ".join(container["args"]).lower()


def test_router_probes_and_scrape_annotations():
    (router,) = by_kind("Deployment")
    pod = router["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in container


def test_slurm_script_is_valid_bash():
    script = DEPLOY / "slurm" / "pdserve.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(script)], check=True)


def test_slurm_config_is_a_ray_pipeline():
    from pdserve.cluster.config import load_pipeline
    from pdserve.cluster.ray import actor_options

    pipeline = load_pipeline(DEPLOY / "slurm" / "pdserve-cluster.yaml", {"placement": "ray"})
    assert actor_options(pipeline.prefill)["resources"] == {"prefill_pool": 1}
    assert actor_options(pipeline.decode)["resources"] == {"decode_pool": 1}
    script = (DEPLOY / "slurm" / "pdserve.sbatch").read_text()
    assert "prefill_pool" in script and "decode_pool" in script
