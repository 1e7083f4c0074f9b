"""Deployments: a Pipeline of roles, and the launcher that runs it (the only code that starts
processes): `make_cluster(pipeline)` is `Cluster` on this host or `RayCluster` (placement: ray)."""

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, ClusterError
from pdserve.cluster.up import make_cluster
from pdserve.transfer import KVTransferConfig

__all__ = ["Cluster", "ClusterError", "Pipeline", "WorkerGroup", "KVTransferConfig", "make_cluster"]
