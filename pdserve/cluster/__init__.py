"""Deployments: a Pipeline of roles, and the launcher that runs it (the only code that starts
processes)."""

from pdserve.cluster.config import Pipeline, Role, TensorStore
from pdserve.cluster.launcher import Cluster, ClusterError

__all__ = ["Cluster", "ClusterError", "Pipeline", "Role", "TensorStore"]
