"""The head's watchdog on real Ray nodes: a lost node stops the API server within the bound."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from vllm_zerocopy_testbed.node import watchdog
from vllm_zerocopy_testbed.waits import wait_until
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec, ReusedCluster

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

# compose/.env's detection settings, so the bound measured here is the cluster's.
DETECTION_ENV = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "4000",
                 "RAY_health_check_failure_threshold": "4"}
BOUND_S = 60.0


@pytest.fixture(scope="module")
def _nodes():
    """One cluster for both tests (a start is ~8 s): the server's exit leaves it whole, the lost
    node's test runs last; ``stop`` raises if anything of it survived."""
    nodes = ReusedCluster([RayNodeSpec("127.0.0.2"), RayNodeSpec("127.0.0.3")], env={**os.environ, **DETECTION_ENV})
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def two_nodes(_nodes: ReusedCluster) -> LocalRayCluster:
    return _nodes.get()


def _start(address: str, server: subprocess.Popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm_zerocopy_testbed.node.watchdog", "--address", address,
                             "--nodes", "2", "--server-pid", str(server.pid), "--grace", "2", "--node-ip", "127.0.0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class _Output:
    """``proc``'s output lines, read by a thread as they come (the process is never blocked on a pipe)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        self._reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, marker: str, timeout: float) -> None:
        wait_until(f"a {marker!r} line", lambda: any(marker in line for line in list(self.lines)),
                   timeout=timeout, poll_s=0.1, progress=lambda: "".join(self.lines)[-2000:])

    def text(self) -> str:
        """All of it, once the process has exited (its pipe closed)."""
        self._reader.join(timeout=10)
        return "".join(self.lines)


def test_a_server_that_exits_makes_the_watchdog_exit_non_zero(two_nodes) -> None:
    server = subprocess.Popen(["sleep", "3"], start_new_session=True)  # vLLM exits 0 once its engine died
    guard = _start(two_nodes.address, server)
    try:
        status = guard.wait(timeout=60)
    finally:
        if guard.poll() is None:
            guard.kill()
    assert status == watchdog.EXIT_SERVER_GONE


def test_a_lost_node_stops_the_server_and_the_watchdog_exits_non_zero(two_nodes) -> None:
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stands in for the API server
    guard = _start(two_nodes.address, server)
    output = _Output(guard)
    try:
        output.wait_for("watching", timeout=60)
        time.sleep(3)  # more than one health check period (2 s) with every node alive
        assert guard.poll() is None and server.poll() is None, \
            f"the watchdog acted with every node alive:\n{''.join(output.lines)}"
        lost_at = time.monotonic()
        two_nodes.kill_node(1)
        status = guard.wait(timeout=BOUND_S + 30)
        server.wait(timeout=15)
        took = time.monotonic() - lost_at
    finally:
        for proc in (guard, server):
            if proc.poll() is None:
                proc.kill()
    out = output.text()
    assert status == watchdog.EXIT_NODE_LOST, out
    assert server.returncode is not None and took <= BOUND_S, f"server stopped {took:.0f} s after the loss\n{out}"
