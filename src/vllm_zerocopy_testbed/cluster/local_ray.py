"""Ray nodes as local processes on 127.0.0.x: the cluster for machines without Docker.

Each node is one ``ray start --block`` in its own session, so stopping a node
signals exactly the process group we started (never ``ray stop``, which stops
every Ray on the machine). Every node gets its own address (127.0.0.1 is
rewritten by Ray to the eth0 address) and its own port range.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from vllm_zerocopy_testbed.cluster import locks
from vllm_zerocopy_testbed.cluster.interface import ClusterStartError
from vllm_zerocopy_testbed.cluster.process import is_stopped, session_pids, signal_matching, signal_session
from vllm_zerocopy_testbed.cluster.shm import ShmClaim, owner_pids
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.node import ray_nodes
from vllm_zerocopy_testbed.waits import WaitTimeout, wait_until

logger = logging.getLogger(__name__)
LOCK = "local-ray"  # locks.py: who owns the fixed addresses and ports below


@dataclass(frozen=True)
class RayNodeSpec:
    """One Ray node: its loopback address and the resources it advertises."""

    ip: str
    num_cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    num_gpus: float = 0  # real GPUs (the gpu profile); the CPU profile advertises fake HPU units


def _ports(index: int) -> dict[str, int]:
    """Return a fixed, per-node block of ports (base 24000 + 1000 per node)."""
    base = 24000 + 1000 * index
    return {
        "--node-manager-port": base + 1,
        "--object-manager-port": base + 2,
        "--runtime-env-agent-port": base + 3,
        "--dashboard-agent-grpc-port": base + 4,
        "--dashboard-agent-listen-port": base + 5,
        "--metrics-export-port": base + 6,
        "--min-worker-port": base + 100,
        "--max-worker-port": base + 999,
    }


_HEAD_PORT = 23999
_CLIENT_SERVER_PORT = 23998


class LocalRayCluster:
    """Start Ray nodes as local processes; a context manager that always stops them."""

    def __init__(
        self,
        nodes: list[RayNodeSpec],
        env: Mapping[str, str] | None = None,
        start_timeout: float = 90.0,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        for node in nodes:
            if node.ip == "127.0.0.1":
                raise ValueError("use 127.0.0.2+ for local nodes: Ray rewrites 127.0.0.1 to eth0")
        self.nodes = nodes
        self.env = process_env() if env is None else dict(env)
        self.env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.start_timeout = start_timeout
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self._workdir: Path | None = None
        self._shm: ShmClaim | None = None  # taken at start: what /dev/shm held before us, our token

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{_HEAD_PORT}"

    def __enter__(self) -> "LocalRayCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every node and wait (bounded) until all are alive."""
        # The nodes' addresses and ports are fixed (and the local backend's API port): one local
        # cluster per machine at a time. Another run's: a clear error now, not a port clash later.
        if not locks.hold(LOCK):
            raise ClusterStartError(f"the local Ray cluster's addresses and ports (127.0.0.2-5, {_CLIENT_SERVER_PORT}-"
                                    f"{24000 + 1000 * len(self.nodes) - 1}) are in use by another run on this machine "
                                    f"({locks.holder(LOCK)}): one local cluster at a time; wait for it to end")
        # Every process of our nodes (and their workers) inherits the claim's token: how stop() and
        # leftovers() find ours, and only ours, and what they hold in /dev/shm is recorded while they
        # live; only that is removed at stop.
        self._shm = ShmClaim.take()
        self.env.update(self._shm.env)
        self._shm.watch()
        # Short path: Ray's unix sockets live under the temp dir (108-byte limit).
        self._workdir = Path(tempfile.mkdtemp(prefix="rtb", dir="/tmp"))
        self._logs = []
        try:
            for index, node in enumerate(self.nodes):
                self._procs.append(self._start_node(index, node))
            self.wait_for_nodes(len(self.nodes), self.start_timeout)
        except BaseException:
            self.stop()
            raise

    def _start_node(self, index: int, node: RayNodeSpec) -> "subprocess.Popen[bytes]":
        assert self._workdir is not None
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={node.ip}"]
        cmd += [f"--num-cpus={node.num_cpus}", f"--resources={json.dumps(dict(node.resources))}"]
        cmd += [f"--num-gpus={node.num_gpus:g}"] if node.num_gpus else []
        cmd += [f"{flag}={port}" for flag, port in _ports(index).items()]
        if index == 0:
            cmd += ["--head", f"--port={_HEAD_PORT}", "--include-dashboard=false"]
            cmd += [f"--ray-client-server-port={_CLIENT_SERVER_PORT}"]
            cmd += [f"--temp-dir={self._workdir / 'ray'}"]
        else:
            cmd += [f"--address={self.address}"]
        log = self._workdir / f"node{index}.log"
        if log not in self._logs:
            self._logs.append(log)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        logger.info("ray node %d on %s: pid %d", index, node.ip, proc.pid)
        return proc

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        """Wait until ``count`` nodes are alive; raise with the nodes' logs after ``timeout``."""

        def exited() -> str | None:
            dead = [p.pid for p in self._procs if p.poll() is not None]
            return f"ray node process(es) {dead} exited" if dead else None

        try:
            ray_nodes.wait_for_nodes(self.address, count, timeout, self.env, abort=exited)
        except (RuntimeError, TimeoutError) as exc:
            raise ClusterStartError(f"{exc}\n{self.logs_tail()}") from None

    def logs_tail(self, lines: int = 30) -> str:
        parts = []
        for log in self._logs:
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- {log.name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    # -- nemeses: a node is every process of its `ray start` session ----------------------
    def node_pids(self, index: int) -> list[int]:
        """Every live process of node ``index``: raylet, agents, and the workers it spawned
        (each worker has its own process group, but stays in the node's session)."""
        return session_pids(self._procs[index].pid)

    def kill_node(self, index: int) -> None:
        """SIGKILL every process of node ``index`` at once (a lost host)."""
        proc = self._procs[index]
        if self._shm is not None:
            self._shm.record()  # what it holds: SIGKILL leaves it behind
        signal_session(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("ray node pid %d did not exit after SIGKILL", proc.pid)

    def pause_node(self, index: int) -> list[int]:
        """SIGSTOP every process of node ``index``; return them."""
        return signal_session(self._procs[index].pid, signal.SIGSTOP)

    def resume_node(self, index: int) -> list[int]:
        """SIGCONT every process of node ``index``; return them."""
        return signal_session(self._procs[index].pid, signal.SIGCONT)

    def signal_processes(self, index: int, pattern: str, signum: int = signal.SIGKILL,
                         count: int | None = None) -> list[int]:
        """Send ``signum`` to the processes of node ``index`` whose command line contains ``pattern``
        (the first ``count`` by PID, or all); return them."""
        return signal_matching(self._procs[index].pid, pattern, signum, count)

    def restart_node(self, index: int, timeout: float = 60.0) -> None:
        """Kill node ``index`` and start it again (same address, ports, resources); wait until it joined."""
        self.kill_node(index)
        self._procs[index] = self._start_node(index, self.nodes[index])
        self.wait_for_nodes(len(self.nodes), timeout)

    def node_state(self, index: int) -> str:
        """running, paused (its ``ray start`` stopped by a signal) or exited."""
        proc = self._procs[index] if index < len(self._procs) else None
        if proc is None:
            return "missing"
        if proc.poll() is not None:
            return "exited"
        return "paused" if is_stopped(proc.pid) else "running"

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every node we started (by process group), then remove our files."""
        # SIGTERM to the `ray start --block` leader only: it stops its children
        # in ~3 s, while a group-wide SIGTERM is ignored by gcs_server and others.
        # A paused node (a nemesis) acts on it only once continued.
        if self._shm is not None:
            self._shm.record()  # what our processes hold: what a kill leaves behind
        for proc in self._procs:
            signal_session(proc.pid, signal.SIGCONT)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group outlives its leader when Ray's children linger.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("ray node pid %d did not exit after SIGKILL", proc.pid)
        self._procs.clear()
        # A worker whose raylet crashed (Ray's teardown after a channel stall does that) is no
        # longer in the node's process group: end each process of our session by its PID.
        self._kill_session_processes(timeout=10)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._shm is not None:
            self._shm.remove_new()

    def _session_processes(self) -> dict[int, str]:
        """PID -> command line of every live process of ours (Ray renames its workers' command lines;
        their environment still carries our claim's token)."""
        found: dict[int, str] = {}
        for pid in owner_pids(self._shm.token) if self._shm is not None else []:
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
        return found

    def _kill_session_processes(self, timeout: float) -> None:
        """SIGKILL each process of our session by PID until none is left (at most ``timeout`` s)."""

        def none_left() -> bool:
            pids = self._session_processes()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            return not pids

        try:
            wait_until("our Ray session's processes gone", none_left, timeout=timeout, poll_s=0.1,
                       progress=lambda: f"left: {sorted(self._session_processes())}")
        except WaitTimeout as exc:
            logger.warning("%s", exc)  # leftovers() reports them

    def leftovers(self) -> list[str]:
        """Return what our nodes left behind: live processes of our Ray session, /dev/shm files."""
        found = [f"ray node pid {p.pid} still running" for p in self._procs if p.poll() is None]
        found += [f"pid {pid} of our Ray session: {title[:80]}" for pid, title in self._session_processes().items()]
        found += self._shm.paths() if self._shm is not None else []
        return found


class ReusedCluster:
    """One ``LocalRayCluster`` serving test after test (a start is ~20 s on 2 cores): started by
    ``get`` when none runs, replaced when a node is no longer running or a test marked it ``spent``
    (a stalled compiled graph crashes a raylet at teardown; a restarted node is still placed on
    under its old entry until the health checks miss it)."""

    def __init__(self, nodes: list[RayNodeSpec], env: Mapping[str, str] | None = None,
                 stop_timeout: float = 3.0) -> None:
        self.nodes, self.env, self.stop_timeout = nodes, env, stop_timeout
        self.cluster: LocalRayCluster | None = None
        self.spent = False

    def get(self) -> LocalRayCluster:
        """The running cluster, or a fresh one in place of a spent or broken one."""
        if self.cluster is not None and (self.spent or any(
                self.cluster.node_state(i) != "running" for i in range(len(self.nodes)))):
            self.stop()
        if self.cluster is None:
            self.cluster = LocalRayCluster(self.nodes, env=self.env)
            self.cluster.start()
        self.spent = False
        return self.cluster

    def stop(self) -> None:
        """Stop the cluster, if any, with a short grace (a crashed or restarted node's `ray start`
        leader waits out a long one); raise if anything of it survived."""
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.stop(timeout=self.stop_timeout)
            left = cluster.leftovers()
            if left:
                raise RuntimeError(f"the Ray cluster left behind: {left}")
