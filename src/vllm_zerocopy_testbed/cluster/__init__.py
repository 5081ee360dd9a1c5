"""Clusters the suites run against: Docker Compose (default) or local processes."""

from __future__ import annotations

from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.config import cluster_backend


def cluster_from_env(up_timeout: float = 600.0) -> Cluster:
    """Return the (not yet started) cluster that ``TESTBED_CLUSTER`` names."""
    if cluster_backend() == "local":
        from vllm_zerocopy_testbed.cluster.local_vllm import LocalVllmCluster

        return LocalVllmCluster(up_timeout=up_timeout)
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster

    return ComposeCluster(up_timeout=up_timeout)
