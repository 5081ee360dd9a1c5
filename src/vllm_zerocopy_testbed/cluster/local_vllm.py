"""The local backend: Ray nodes and the OpenAI server as processes on 127.0.0.x (no Docker).

Same interface as ``ComposeCluster``, nemeses included: a node is every process of
its ``ray start`` session (Ray gives each worker its own process group, not its own
session), and the head node also holds the API server and its watchdog. Nodes share
this machine's /dev/shm and network namespace, so unlike containers the stock
communicator would "work" here, and no node can be cut off the network alone: the
compose backend is the one that shows cross-host behaviour.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from vllm_zerocopy_testbed.cluster.api_server import ApiServerProcess
from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec
from vllm_zerocopy_testbed.cluster.placement import RankPlacement, parse_mode_lines, parse_placement_by_pid
from vllm_zerocopy_testbed.cluster.process import is_stopped, session_pids, signal_matching, signal_session, stop_group
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.host_config import ClusterSettings
from vllm_zerocopy_testbed.model import build, model_dir, spec_for
from vllm_zerocopy_testbed.node import usage as node_usage
from vllm_zerocopy_testbed.node.serve import serve_argv, serve_env
from vllm_zerocopy_testbed.node.warmup import warms_logprobs
from vllm_zerocopy_testbed.workload.warmup import warm_up

HEAD_IP = "127.0.0.3"
WORKER_IPS = ("127.0.0.2", "127.0.0.4", "127.0.0.5")
API_PORT = 8011


class LocalVllmCluster(Cluster):
    """Head node (Ray, the API server, its watchdog) and worker nodes as local process sessions."""

    UNSUPPORTED = {**{op: "local nodes share one network namespace (loopback): none can be cut off alone; "
                          "TESTBED_CLUSTER=compose" for op in ("isolate", "rejoin")},
                   **{op: "local nodes share this machine's /dev/shm: filling it hurts more than one node "
                          "(and the machine); TESTBED_CLUSTER=compose" for op in ("fill_shm", "free_shm")}}

    def __init__(self, settings: ClusterSettings | None = None, up_timeout: float = 600.0) -> None:
        self.settings = settings or ClusterSettings.from_env()
        self.up_timeout = up_timeout
        workers = int(self.settings["TESTBED_WORKERS"])
        if self.settings.device_profile == "gpu":  # vLLM's CUDA platform asks Ray for `GPU`
            devices = {"num_gpus": float(self.settings["TESTBED_GPUS_PER_NODE"])}
        else:
            devices = {"resources": {"HPU": float(self.settings["TESTBED_HPU_PER_NODE"])}}
        # The nodes get the cluster's settings as the containers do (Ray's node-loss detection
        # from compose/.env among them).
        self.ray = LocalRayCluster(
            [RayNodeSpec(HEAD_IP, **devices), *(RayNodeSpec(ip, **devices) for ip in WORKER_IPS[:workers])],
            env=process_env(**self.settings.values, **self.settings.node_env),
        )
        self._server = ApiServerProcess("API server", "testbed-api-")
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watchdog_log = Path(tempfile.mkstemp(prefix="testbed-watchdog-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://{HEAD_IP}:{API_PORT}/v1"

    def is_running(self) -> bool:
        """Return whether this object's server is up (a local cluster is never shared)."""
        return self._server.running()

    def up(self) -> float:
        """Start Ray nodes, the API server and its watchdog; wait (bounded) for ``/health`` and a
        warm-up answer; return seconds. Called again (after a nemesis), it starts afresh."""
        self.down()  # what a nemesis left of an earlier up (a no-op on the first)
        start = time.monotonic()
        spec = spec_for(self.settings["TESTBED_MODEL"])  # the variant the node image has at that path
        directory = model_dir(spec)
        build(directory, spec)
        self.ray.start()
        values = {**self.settings.values, "TESTBED_MODEL": str(directory)}
        argv = serve_argv(replace(self.settings, values=values), host=HEAD_IP, port=API_PORT)
        env = {**process_env(), **values, **self.settings.node_env, **serve_env(self.settings), "RAY_ADDRESS": self.ray.address,
               "VLLM_HOST_IP": HEAD_IP,
               "TESTBED_RAY_DRIVER_IP": HEAD_IP,  # the engine is the head node's driver
               "RAY_DEDUP_LOGS": "0"}  # every worker's rank and mode line, not one per kind
        self._server.start(argv, env)
        self._server.wait_healthy(self.base_url.removesuffix("/v1"), max(0.0, start + self.up_timeout - time.monotonic()),
                                  poll_s=2)
        # Up means warmed up, as in the compose head: the first request compiles.
        warm_up(self.base_url.removesuffix("/v1"), self.settings["TESTBED_SERVED_MODEL"],
                timeout=max(1.0, start + self.up_timeout - time.monotonic()),
                logprobs=warms_logprobs(self.settings.executor.value, self.settings.values.get("TESTBED_INFLIGHT", "testbed")))
        self._start_watchdog()
        return time.monotonic() - start

    def _start_watchdog(self) -> None:
        """The head's watchdog (``node/watchdog.py``), as ``testbed-head`` runs it: a lost node or a
        dead vLLM worker actor stops the API server at once."""
        assert self._server.proc is not None
        argv = [sys.executable, "-m", "vllm_zerocopy_testbed.node.watchdog", "--address", self.ray.address,
                "--nodes", str(len(self.ray.nodes)), "--server-pid", str(self._server.proc.pid),
                "--grace", self.settings.values.get("TESTBED_WATCHDOG_GRACE_S", "2"), "--node-ip", HEAD_IP]
        with open(self._watchdog_log, "ab") as out:
            self._watchdog = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                              env=process_env(**self.settings.values))

    def down(self) -> None:
        if self._watchdog is not None:
            signal_session(self._watchdog.pid, signal.SIGCONT)
            stop_group(self._watchdog, grace_s=5)
            self._watchdog = None
        self._server.stop()
        self.ray.stop()

    def leftovers(self) -> list[str]:
        watchdog = [f"watchdog pid {self._watchdog.pid}"] if self._watchdog and self._watchdog.poll() is None else []
        return watchdog + self._server.leftover() + self.ray.leftovers()

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        text = self._server.logs(tail)
        if self._watchdog_log.exists():
            watchdog = self._watchdog_log.read_text(errors="replace").splitlines()
            text += "\n" + "\n".join(watchdog[-tail:] if tail else watchdog)
        return text

    def placement(self) -> list[RankPlacement]:
        nodes = {HEAD_IP: "head", **{ip: f"worker-{i + 1}" for i, ip in enumerate(WORKER_IPS)}}
        return parse_placement_by_pid(self.logs(), nodes, int(self.settings["TESTBED_TP"]))

    def mode_lines(self) -> list[str]:
        return parse_mode_lines(self.logs())

    # -- nemeses ------------------------------------------------------------
    def _index(self, node: str) -> int:
        """head -> 0, worker (or worker-N) -> N."""
        if node == "head":
            return 0
        number = node.removeprefix("worker").lstrip("-") or "1"
        if not number.isdigit() or not 1 <= int(number) < len(self.ray.nodes):
            raise LookupError(f"no node {node!r}: head, worker-1..{len(self.ray.nodes) - 1}")
        return int(number)

    def _head_sessions(self) -> list[int]:
        """The head's processes beyond its Ray node: the API server (with the engine) and the watchdog."""
        return [p.pid for p in (self._server.proc, self._watchdog) if p is not None and p.poll() is None]

    def _signal_head(self, index: int, signum: int) -> None:
        """On the head, the API server's and the watchdog's sessions too (a container holds them all)."""
        for sid in self._head_sessions() if index == 0 else []:
            signal_session(sid, signum)

    def kill(self, node: str) -> None:
        index = self._index(node)
        self._signal_head(index, signal.SIGKILL)
        self.ray.kill_node(index)

    def pause(self, node: str) -> None:
        self._signal_head(self._index(node), signal.SIGSTOP)
        self.ray.pause_node(self._index(node))

    def resume(self, node: str) -> None:
        self.ray.resume_node(self._index(node))
        self._signal_head(self._index(node), signal.SIGCONT)

    def restart(self, node: str) -> None:
        """Kill the node and start its Ray node again (the head: the whole cluster, as its container would)."""
        index = self._index(node)
        if index == 0:
            self.up()
            return
        self.ray.restart_node(index)

    def signal_process(self, node: str, pattern: str, signum: int = signal.SIGKILL,
                       count: int | None = None) -> list[int]:
        index = self._index(node)
        pids = self.ray.signal_processes(index, pattern, signum, count)
        for sid in self._head_sessions() if index == 0 else []:
            if count is None or len(pids) < count:
                pids += signal_matching(sid, pattern, signum, None if count is None else count - len(pids))
        return pids

    def usage(self, node: str) -> dict[str, float]:
        """The node's process sessions; /dev/shm is this machine's, shared by every node: the
        head's sample carries it, the workers' do not."""
        index = self._index(node)
        pids = set(self.ray.node_pids(index))
        for sid in self._head_sessions() if index == 0 else []:
            pids.update(session_pids(sid))
        figures = {**node_usage.processes(sorted(pids)), **node_usage.by_process(pids),
                   **node_usage.heap(pids, node_usage.largest(pids)), **node_usage.onednn_cached(pids)}
        if index == 0:
            figures.update(node_usage.shm())
        figures.update(node_usage.object_store(self.ray.address, self.ray.nodes[index].ip))
        return figures

    def state(self, node: str) -> str:
        index = self._index(node)
        ray_state = self.ray.node_state(index)
        if index == 0 and ray_state == "running":
            if not self._server.running():
                return "exited"
            if self._server.proc is not None and is_stopped(self._server.proc.pid):
                return "paused"
        return ray_state

