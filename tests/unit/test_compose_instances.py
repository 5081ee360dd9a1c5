"""Compose instances (runs side by side): a run owns its compose project, its published ports
and its network; one whose project another live run holds takes the next instance, or says who holds it.

The lock is real (``flock`` across processes, as two runs are); the projects are the test's own names,
so a cluster of the machine is never touched, and no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from vllm_zerocopy_testbed.cluster import locks
from vllm_zerocopy_testbed.cluster.compose import ComposeCluster, ProjectBusy
from vllm_zerocopy_testbed.config import ConfigError
from vllm_zerocopy_testbed.host_config import ClusterSettings

pytestmark = pytest.mark.unit

HOLDER = """
import sys, time
from vllm_zerocopy_testbed.cluster import locks
assert locks.hold(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


PROJECTS: list[str] = []  # the test's own projects: their lock files go after each test


def _settings(**values: str) -> ClusterSettings:
    PROJECTS.append(f"tb-claim-{uuid.uuid4().hex[:8]}")
    return ClusterSettings.from_env({"COMPOSE_PROJECT_NAME": PROJECTS[-1], **values})


@pytest.fixture
def holder():
    """Start a process (another run) that holds a project's lock until the test ends."""
    procs: list[subprocess.Popen[str]] = []

    def start(name: str, raw: bool = False) -> subprocess.Popen[str]:
        """Hold the lock of compose project ``name`` (``raw``: the lock called ``name``)."""
        lock = name if raw else f"compose-{name}"
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, lock], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def _drop_our_locks():
    yield
    for base in PROJECTS:
        for suffix in ("", "-1", "-2"):
            locks.release(f"compose-{base}{suffix}")
            (locks.LOCK_DIR / f"compose-{base}{suffix}.lock").unlink(missing_ok=True)
    PROJECTS.clear()


def test_instance_zero_is_compose_env_as_it_is_and_n_moves_project_ports_and_network() -> None:
    base = ClusterSettings.from_env({})
    assert (base.project, base.api_port, base.head_ip) == ("zerocopy-testbed", 8000, "172.29.77.10")
    two = base.for_instance(2)
    assert two.instance_values == {"COMPOSE_PROJECT_NAME": "zerocopy-testbed-2", "API_PORT": "8200",
                                   "DASHBOARD_PORT": "", "TESTBED_SUBNET": "172.29.99"}  # no dashboard: Docker's pick
    assert ClusterSettings.from_env({"TESTBED_DASHBOARD": "1"}).for_instance(2).instance_values["DASHBOARD_PORT"] == "8465"
    assert (two.base_url, two.head_ip) == ("http://127.0.0.1:8200/v1", "172.29.99.10")
    # what compose renders for it: the project's network on its own subnet, its own published ports
    rendered = json.loads(ComposeCluster(two).compose("config", "--format", "json", timeout=60).stdout)
    assert rendered["name"] == "zerocopy-testbed-2"
    assert rendered["networks"]["testbed"]["ipam"]["config"][0]["subnet"] == "172.29.99.0/24"
    assert rendered["services"]["head"]["networks"]["testbed"]["ipv4_address"] == "172.29.99.10"
    ports = {p["target"]: p.get("published") for p in rendered["services"]["head"]["ports"]}
    assert ports[8000] == "8200" and not ports[8265], ports  # the dashboard's: a port Docker picks


@pytest.mark.parametrize("values, message", [
    ({"TESTBED_INSTANCE": "10"}, "TESTBED_INSTANCE='10' is invalid"),
    ({"TESTBED_INSTANCE": "one"}, "TESTBED_INSTANCE='one' is invalid"),
    ({"TESTBED_SUBNET": "172.29"}, "TESTBED_SUBNET='172.29' is invalid"),
    ({"TESTBED_SUBNET": "10.0.250"}, "TESTBED_SUBNET='10.0.250' is invalid"),
    ({"API_PORT": "80a"}, "API_PORT='80a' is not a port number"),
])
def test_a_bad_instance_setting_is_refused_before_anything_starts(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ClusterSettings.from_env(values)


def test_a_run_takes_the_next_instance_when_another_live_run_holds_its_project(holder) -> None:
    settings = _settings()
    other = holder(settings.project)
    cluster = ComposeCluster(settings)
    cluster.claim(auto=True)
    assert cluster.settings.instance == 1 and cluster.settings.project == f"{settings.project}-1"
    assert cluster.base_url == "http://127.0.0.1:8100/v1" and cluster._env["COMPOSE_PROJECT_NAME"] == cluster.settings.project
    assert cluster._env["TESTBED_SUBNET"] == "172.29.98"
    cluster.claim(auto=True)  # this process holds it already: no further move
    assert cluster.settings.instance == 1
    # a third run: 0 and 1 held, it gets 2
    third = subprocess.run([sys.executable, "-c",
                            "import sys; from vllm_zerocopy_testbed.cluster.compose import ComposeCluster; "
                            "from vllm_zerocopy_testbed.host_config import ClusterSettings; "
                            "c = ComposeCluster(ClusterSettings.from_env({'COMPOSE_PROJECT_NAME': sys.argv[1]})); "
                            "c.claim(auto=True); print(c.settings.project)", settings.project],
                           capture_output=True, text=True, timeout=60)
    assert third.stdout.strip() == f"{settings.project}-2", third.stderr[-1000:]
    assert other.poll() is None


def test_a_named_instance_held_by_another_run_is_refused_with_its_holder(holder) -> None:
    settings = _settings()
    other = holder(settings.project)
    with pytest.raises(ProjectBusy) as caught:
        ComposeCluster(settings).claim(auto=False)
    assert f"compose project {settings.project} is in use by another run" in str(caught.value)
    assert f"pid {other.pid}" in str(caught.value) and "TESTBED_INSTANCE=1" in str(caught.value)
    other.kill()
    other.wait(timeout=10)
    cluster = ComposeCluster(settings)
    cluster.claim(auto=False)  # the kernel dropped the dead run's lock
    assert cluster.settings.project == settings.project


def test_make_down_refuses_a_project_another_run_holds(holder) -> None:
    settings = _settings()
    holder(settings.project)
    proc = subprocess.run([sys.executable, "-m", "vllm_zerocopy_testbed.cluster.compose", "down"],
                          env={**__import__("os").environ, "COMPOSE_PROJECT_NAME": settings.project},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"make down: compose project {settings.project} is in use" in proc.stderr, \
        proc.stdout + proc.stderr


SECOND_LOCAL = """
from vllm_zerocopy_testbed.cluster.interface import ClusterStartError
from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster, RayNodeSpec
cluster = LocalRayCluster([RayNodeSpec("127.0.0.2")])
try:
    cluster.start()
except ClusterStartError as exc:
    print("refused:", exc, "| ray nodes started:", len(cluster._procs))
"""


def test_a_second_local_ray_cluster_is_refused_while_another_run_holds_the_ports(holder) -> None:
    """The local backend's addresses and ports are fixed: a second run gets a clear error before any
    ``ray start``, and the first's cluster is untouched."""
    from vllm_zerocopy_testbed.cluster.local_ray import LOCK

    if locks.is_free(LOCK):
        first = holder(LOCK, raw=True).pid  # another run
    elif LOCK in locks._HELD:
        first = os.getpid()  # this session's component tests (make test-core runs both in one pytest)
    else:
        pytest.skip(f"a local Ray cluster of this machine holds the lock now ({locks.holder(LOCK)})")
    second = subprocess.run([sys.executable, "-c", SECOND_LOCAL], capture_output=True, text=True, timeout=120)
    assert f"in use by another run on this machine (pid {first}:" in second.stdout, second.stdout + second.stderr[-2000:]
    assert "| ray nodes started: 0" in second.stdout


def test_inside_a_node_without_compose_env_the_settings_still_load(monkeypatch, tmp_path) -> None:
    """A node image has no compose/.env: compose passed the values it has (not the project's name).
    Seen: the head's server exited on a KeyError at start and the head stayed "starting"."""
    from vllm_zerocopy_testbed import host_config

    monkeypatch.setattr(host_config, "COMPOSE_DIR", tmp_path)
    settings = ClusterSettings.from_env({"TESTBED_PP": "2"})
    assert settings.project == "zerocopy-testbed" and settings.head_ip == "172.29.77.10"
