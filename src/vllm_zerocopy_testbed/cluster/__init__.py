"""Clusters the suites run against: Docker Compose (default), local processes, or an external one."""

from __future__ import annotations

from typing import Mapping

from vllm_zerocopy_testbed.cluster.interface import Cluster, ClusterStartError
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.host_config import ClusterSettings, cluster_backend


def cluster_from_env(up_timeout: float = 600.0, overrides: Mapping[str, str] | None = None) -> Cluster:
    """Return the (not yet started) cluster that ``TESTBED_CLUSTER`` names, settings overridden."""
    settings = ClusterSettings.from_env(process_env(**(overrides or {})))
    backend = cluster_backend()
    if backend == "external":
        from vllm_zerocopy_testbed.cluster.external import ExternalCluster

        return ExternalCluster(settings, up_timeout=up_timeout)
    if backend == "local":
        from vllm_zerocopy_testbed import vllm_source
        from vllm_zerocopy_testbed.cluster.local_vllm import LocalVllmCluster

        try:  # VLLM=... that cannot serve here fails now (compose: ComposeCluster.prepare does)
            vllm_source.for_server()
        except vllm_source.VllmSourceError as exc:
            raise ClusterStartError(str(exc)) from None
        return LocalVllmCluster(settings, up_timeout=up_timeout)
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster

    return ComposeCluster(settings, up_timeout=up_timeout)
