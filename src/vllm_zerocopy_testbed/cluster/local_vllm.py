"""The local backend: Ray nodes and the OpenAI server as processes on 127.0.0.x (no Docker).

Same interface as ``ComposeCluster``. Nodes share this machine's /dev/shm, so
unlike containers the stock communicator would "work" here; the compose
backend is the one that shows cross-host behaviour.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from vllm_zerocopy_testbed.cluster.process import stop_group
from vllm_zerocopy_testbed.cluster.interface import Cluster, ClusterStartError
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec
from vllm_zerocopy_testbed.cluster.placement import RankPlacement, parse_mode_lines, parse_placement_by_pid
from vllm_zerocopy_testbed.cluster.serve import serve_argv, serve_env
from vllm_zerocopy_testbed.cluster.warmup import is_healthy, warm_up, warms_logprobs
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
        self._server: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="testbed-api-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://{HEAD_IP}:{API_PORT}/v1"

    def is_running(self) -> bool:
        """Return whether this object's server is up (a local cluster is never shared)."""
        return self._server is not None and self._server.poll() is None

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
        with open(self._log, "wb") as out:
            self._server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_healthy(start + self.up_timeout)
        # Up means warmed up, as in the compose head: the first request compiles.
        warm_up(self.base_url.removesuffix("/v1"), self.settings["TESTBED_SERVED_MODEL"],
                timeout=max(1.0, start + self.up_timeout - time.monotonic()),
                logprobs=warms_logprobs(self.settings.executor.value, self.settings.values.get("TESTBED_INFLIGHT", "testbed")))
        return time.monotonic() - start

    def _wait_healthy(self, deadline: float) -> None:
        url = self.base_url.removesuffix("/v1")
        while not is_healthy(url):
            assert self._server is not None
            if self._server.poll() is not None:
                raise ClusterStartError(f"API server exited ({self._server.returncode})\n{self.logs(tail=60)}")
            if time.monotonic() > deadline:
                raise ClusterStartError(f"API server not healthy within {self.up_timeout:.0f} s\n{self.logs(tail=60)}")
            time.sleep(2)

    def down(self) -> None:
        stop_group(self._server)
        self._server = None
        self.ray.stop()

    def leftovers(self) -> list[str]:
        found = [f"API server pid {self._server.pid} still running"] if self.is_running() else []
        return found + self.ray.leftovers()

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        lines = self._log.read_text(errors="replace").splitlines() if self._log.exists() else []
        return "\n".join(lines[-tail:] if tail else lines)

    def placement(self) -> list[RankPlacement]:
        nodes = {HEAD_IP: "head", **{ip: f"worker-{i + 1}" for i, ip in enumerate(WORKER_IPS)}}
        return parse_placement_by_pid(self.logs(), nodes, int(self.settings["TESTBED_TP"]))

    def mode_lines(self) -> list[str]:
        return parse_mode_lines(self.logs())

    def kill(self, service: str) -> None:
        self.ray.kill_node(0 if service == "head" else 1)
