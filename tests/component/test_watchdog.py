"""The head's watchdog on real Ray nodes: a lost node stops the API server within the bound."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_zerocopy_testbed.node import watchdog
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

# compose/.env's detection settings, so the bound measured here is the cluster's.
DETECTION_ENV = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "4000",
                 "RAY_health_check_failure_threshold": "4"}
BOUND_S = 60.0


@pytest.fixture
def two_nodes():
    cluster = LocalRayCluster([RayNodeSpec("127.0.0.2"), RayNodeSpec("127.0.0.3")], env={**os.environ, **DETECTION_ENV})
    with cluster:
        yield cluster
    assert not cluster.leftovers(), cluster.leftovers()


def _start(address: str, server: subprocess.Popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm_zerocopy_testbed.node.watchdog", "--address", address,
                             "--nodes", "2", "--server-pid", str(server.pid), "--grace", "2", "--node-ip", "127.0.0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_lost_node_stops_the_server_and_the_watchdog_exits_non_zero(two_nodes) -> None:
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stands in for the API server
    guard = _start(two_nodes.address, server)
    try:
        time.sleep(8)  # connected and watching
        assert guard.poll() is None and server.poll() is None, "the watchdog acted with every node alive"
        lost_at = time.monotonic()
        two_nodes.kill_node(1)
        status = guard.wait(timeout=BOUND_S + 30)
        server.wait(timeout=15)
        took = time.monotonic() - lost_at
    finally:
        for proc in (guard, server):
            if proc.poll() is None:
                proc.kill()
    out = guard.stdout.read() if guard.stdout else ""
    assert status == watchdog.EXIT_NODE_LOST, out
    assert server.returncode is not None and took <= BOUND_S, f"server stopped {took:.0f} s after the loss\n{out}"


def test_a_server_that_exits_makes_the_watchdog_exit_non_zero(two_nodes) -> None:
    server = subprocess.Popen(["sleep", "3"], start_new_session=True)  # vLLM exits 0 once its engine died
    guard = _start(two_nodes.address, server)
    try:
        status = guard.wait(timeout=60)
    finally:
        if guard.poll() is None:
            guard.kill()
    assert status == watchdog.EXIT_SERVER_GONE
