"""The local backend: Ray nodes and the OpenAI server as processes on 127.0.0.x (no Docker).

Same interface as ``ComposeCluster``. Nodes share this machine's /dev/shm, so
unlike containers the stock communicator would "work" here; the compose
backend is the one that shows cross-host behaviour.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from vllm_zerocopy_testbed.cluster.api_server import ApiServerProcess
from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec
from vllm_zerocopy_testbed.cluster.placement import RankPlacement, parse_mode_lines, parse_placement_by_pid
from vllm_zerocopy_testbed.node.serve import serve_argv, serve_env
from vllm_zerocopy_testbed.node.warmup import warm_up, warms_logprobs
from vllm_zerocopy_testbed.config import ClusterSettings
from vllm_zerocopy_testbed.model import DEFAULT_DIR, build

HEAD_IP = "127.0.0.3"
WORKER_IPS = ("127.0.0.2", "127.0.0.4", "127.0.0.5")
API_PORT = 8011


class LocalVllmCluster(Cluster):
    """Head node (with the API server) and worker nodes as local process groups."""

    def __init__(self, settings: ClusterSettings | None = None, up_timeout: float = 600.0) -> None:
        self.settings = settings or ClusterSettings.from_env()
        self.up_timeout = up_timeout
        workers = int(self.settings["TESTBED_WORKERS"])
        if self.settings.device_profile == "gpu":  # vLLM's CUDA platform asks Ray for `GPU`
            devices = {"num_gpus": float(self.settings["TESTBED_GPUS_PER_NODE"])}
        else:
            devices = {"resources": {"HPU": float(self.settings["TESTBED_HPU_PER_NODE"])}}
        self.ray = LocalRayCluster(
            [RayNodeSpec(HEAD_IP, **devices), *(RayNodeSpec(ip, **devices) for ip in WORKER_IPS[:workers])]
        )
        self._server = ApiServerProcess("API server", "testbed-api-")

    @property
    def base_url(self) -> str:
        return f"http://{HEAD_IP}:{API_PORT}/v1"

    def is_running(self) -> bool:
        """Return whether this object's server is up (a local cluster is never shared)."""
        return self._server.running()

    def up(self) -> float:
        """Start Ray nodes and the API server; wait (bounded) for ``/health``; return seconds."""
        start = time.monotonic()
        model_dir = DEFAULT_DIR
        build(model_dir)
        self.ray.start()
        values = {**self.settings.values, "TESTBED_MODEL": str(model_dir)}
        argv = serve_argv(replace(self.settings, values=values), host=HEAD_IP, port=API_PORT)
        env = {**os.environ, **values, **serve_env(self.settings), "RAY_ADDRESS": self.ray.address, "VLLM_HOST_IP": HEAD_IP,
               "TESTBED_RAY_DRIVER_IP": HEAD_IP,  # the engine is the head node's driver
               "RAY_DEDUP_LOGS": "0"}  # every worker's rank and mode line, not one per kind
        self._server.start(argv, env)
        self._server.wait_healthy(self.base_url.removesuffix("/v1"), max(0.0, start + self.up_timeout - time.monotonic()),
                                  poll_s=2)
        # Up means warmed up, as in the compose head: the first request compiles.
        warm_up(self.base_url.removesuffix("/v1"), self.settings["TESTBED_SERVED_MODEL"],
                timeout=max(1.0, start + self.up_timeout - time.monotonic()),
                logprobs=warms_logprobs(self.settings.executor.value, self.settings.values.get("TESTBED_INFLIGHT", "testbed")))
        return time.monotonic() - start

    def down(self) -> None:
        self._server.stop()
        self.ray.stop()

    def leftovers(self) -> list[str]:
        return self._server.leftover() + self.ray.leftovers()

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        return self._server.logs(tail)

    def placement(self) -> list[RankPlacement]:
        nodes = {HEAD_IP: "head", **{ip: f"worker-{i + 1}" for i, ip in enumerate(WORKER_IPS)}}
        return parse_placement_by_pid(self.logs(), nodes, int(self.settings["TESTBED_TP"]))

    def mode_lines(self) -> list[str]:
        return parse_mode_lines(self.logs())

    def kill(self, service: str) -> None:
        self.ray.kill_node(0 if service == "head" else 1)
