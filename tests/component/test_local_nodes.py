"""The local backend's node nemeses on real Ray nodes: a node is its whole ``ray start`` session.

Ray gives each worker process its own process group, so signalling a node's group would miss
the very actors vLLM runs; these tests place an actor on the second node and check that
pause, resume, signal-by-pattern and restart reach it (and only it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec, ReusedCluster
from vllm_zerocopy_testbed.cluster.process import is_stopped
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.waits import wait_until

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

# An actor on the node that advertises `probe`, printing its PID, then kept alive by the driver.
_DRIVER = """
import os, sys, time, ray
ray.init(address=sys.argv[1], _node_ip_address="127.0.0.2", logging_level="ERROR", log_to_driver=False)
@ray.remote(num_cpus=0, resources={"probe": 1})
class Probe:
    def pid(self): return os.getpid()
probe = Probe.remote()
print("probe pid", ray.get(probe.pid.remote()), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def _cluster():
    nodes = ReusedCluster([RayNodeSpec("127.0.0.2"), RayNodeSpec("127.0.0.3", resources={"probe": 1})],
                          env=process_env(RAY_health_check_period_ms="2000", RAY_health_check_timeout_ms="4000",
                                          RAY_health_check_failure_threshold="4"))
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def nodes(_cluster: ReusedCluster):
    """Two running nodes: one start serves the pause, signal and restart tests; a killed or
    restarted node gets the next test a fresh cluster."""
    cluster = _cluster.get()
    leaders = [proc.pid for proc in cluster._procs]
    yield cluster
    _cluster.spent = [proc.pid for proc in cluster._procs] != leaders  # a node was restarted


@pytest.fixture
def probe(nodes: LocalRayCluster):
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, nodes.address], stdout=subprocess.PIPE, text=True,
                              env=nodes.env)
    try:
        # Ray may print to a driver's stdout too (a node that a restart replaced is marked dead a
        # while later): the PID is the line that says it is; the test's timeout bounds the wait.
        seen = []
        for line in driver.stdout or ():
            seen.append(line)
            if line.startswith("probe pid "):
                break
        assert seen and seen[-1].startswith("probe pid "), f"the probe actor did not start: {seen!r}"
        yield int(seen[-1].split()[-1])
    finally:
        driver.kill()
        driver.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_pause_stops_the_actors_of_the_node_and_resume_continues_them(nodes: LocalRayCluster, probe: int) -> None:
    assert os.getpgid(probe) != nodes._procs[1].pid, "Ray gave the actor its own process group"
    assert probe in nodes.node_pids(1) and probe not in nodes.node_pids(0)
    stopped = nodes.pause_node(1)
    try:
        # A signal is delivered asynchronously: the state changes a moment after kill() returns.
        assert probe in stopped and wait_until("probe stopped", lambda: is_stopped(probe), timeout=5, poll_s=0.05)
        wait_until("node 1 paused", lambda: nodes.node_state(1) == "paused", timeout=5, poll_s=0.05)
        assert not any(is_stopped(pid) for pid in nodes.node_pids(0)), "the other node runs on"
    finally:
        nodes.resume_node(1)
    wait_until("probe running", lambda: not is_stopped(probe), timeout=5, poll_s=0.05)
    wait_until("node 1 running", lambda: nodes.node_state(1) == "running", timeout=5, poll_s=0.05)


def test_signal_processes_reaches_what_matches_on_that_node_only(nodes: LocalRayCluster, probe: int) -> None:
    # A gray failure first: the actor alone stopped, its node running on.
    assert nodes.signal_processes(1, "ray::Probe", signal.SIGSTOP, count=1) == [probe]
    wait_until("probe stopped", lambda: is_stopped(probe), timeout=5, poll_s=0.05)
    others = [pid for pid in nodes.node_pids(1) if pid != probe]
    assert others and not any(is_stopped(pid) for pid in others), "only the actor stopped"
    assert nodes.node_state(1) == "running"
    assert nodes.signal_processes(1, "ray::Probe", signal.SIGCONT) == [probe]
    wait_until("probe running", lambda: not is_stopped(probe), timeout=5, poll_s=0.05)
    assert nodes.signal_processes(0, "ray::Probe") == [], "no probe on the head node"
    assert nodes.signal_processes(1, "ray::Probe") == [probe]
    deadline = time.monotonic() + 10
    while _alive(probe) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(probe) and nodes.node_state(1) == "running", "the actor died, its node lives"


def test_restart_brings_the_node_back_into_the_cluster(nodes: LocalRayCluster, probe: int) -> None:
    old_leader = nodes._procs[1].pid
    nodes.restart_node(1, timeout=90)
    assert not _alive(probe), "the node's actors went with it"
    assert nodes._procs[1].pid != old_leader and nodes.node_state(1) == "running"
    nodes.wait_for_nodes(2, timeout=10)  # both alive again


def test_kill_ends_every_process_of_the_node(nodes: LocalRayCluster, probe: int) -> None:
    nodes.kill_node(1)
    deadline = time.monotonic() + 10
    while nodes.node_pids(1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not nodes.node_pids(1) and not _alive(probe) and nodes.node_state(1) == "exited"
    assert nodes.node_state(0) == "running"
