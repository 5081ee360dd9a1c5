"""The compose file as Compose renders it: exposure, isolation and pinning."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.host_config import COMPOSE_DIR, ClusterSettings

pytestmark = pytest.mark.unit


def _rendered(profile: str = "cpu", **overrides: str) -> dict:
    compose = Path(sys.executable).with_name("docker-compose")
    settings = ClusterSettings.from_env({**os.environ, "TESTBED_PROFILE": profile, **overrides})
    env = {**os.environ, **settings.values, **overrides}
    files = [arg for f in settings.compose_files for arg in ("-f", str(f))]
    out = subprocess.run([str(compose), *files, "config", "--format", "json"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_only_the_api_and_the_dashboard_are_published_and_only_on_loopback() -> None:
    services = _rendered()["services"]
    assert {(p["host_ip"], p["target"]) for p in services["head"]["ports"]} == {("127.0.0.1", 8000),
                                                                                ("127.0.0.1", 8265)}
    assert "ports" not in services["worker"]


def test_nodes_are_isolated_and_pinned_to_one_core_each() -> None:
    services = _rendered()["services"]
    for name, service in services.items():
        assert not service.get("privileged"), name
        assert service.get("ipc") in (None, "", "private", "shareable"), f"{name} shares the host's IPC"
        assert service["pull_policy"] == "never", name
    assert services["head"]["cpuset"] != services["worker"]["cpuset"]


def test_the_network_is_ours_with_a_fixed_subnet() -> None:
    networks = _rendered()["networks"]
    assert networks["testbed"]["ipam"]["config"][0]["subnet"] == "172.29.77.0/24"


def test_modes_reach_every_node() -> None:
    services = _rendered(TESTBED_BROADCAST="off", TESTBED_DETACH="upstream")["services"]
    for service in services.values():
        assert service["environment"]["TESTBED_BROADCAST"] == "off"
        assert service["environment"]["TESTBED_DETACH"] == "upstream"


def test_the_gpu_override_reserves_real_gpus_and_drops_the_cpu_stand_ins() -> None:
    services = _rendered("gpu")["services"]
    for name, service in services.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 2, "capabilities": ["gpu"]}], name
        env = service["environment"]
        assert env["TESTBED_PROFILE"] == "gpu" and env["TESTBED_CPU_PLATFORM"] == "off", name
        assert env["NCCL_SOCKET_IFNAME"] == "eth0", name
        assert service["image"].endswith(":gpu"), name
        assert "cpuset" not in service, f"{name}: GPU nodes are not pinned to one core"
        assert not service.get("privileged") and service.get("ipc") in (None, "", "private", "shareable"), name
        assert int(service["shm_size"]) >= 8 << 30, name
    assert {p["host_ip"] for p in services["head"]["ports"]} == {"127.0.0.1"}
    assert "ports" not in services["worker"]


def test_the_cpu_profile_is_untouched_by_the_gpu_file() -> None:
    services = _rendered("cpu")["services"]
    assert all("deploy" not in s and s["image"].endswith(":cpu") for s in services.values())


def test_small_tcp_buffers_only_when_asked() -> None:
    """TESTBED_TCP_BUFFERS caps the kernel's buffers in every node container (it widens the send race's window:
    findings/53217-oob-send-race)."""
    assert all("sysctls" not in service for service in _rendered()["services"].values())
    services = _rendered(TESTBED_TCP_BUFFERS="65536")["services"]
    for name in ("head", "worker"):
        assert services[name]["sysctls"] == {"net.ipv4.tcp_rmem": "4096 65536 65536",
                                             "net.ipv4.tcp_wmem": "4096 65536 65536"}, name


def _dotenv(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def test_plain_docker_compose_renders_the_gpu_profile_as_the_testbed_does() -> None:
    """Users on their own GPU hosts run `docker compose -f compose.yaml -f compose.gpu.yaml` without
    the testbed's settings: the GPU file's inline defaults are gpu.env's, and it renders the same."""
    gpu_env = _dotenv(COMPOSE_DIR / "gpu.env")
    inline = dict(re.findall(r"\$\{(\w+):-([^}]*)\}", (COMPOSE_DIR / "compose.gpu.yaml").read_text()))
    assert not re.findall(r"\$\{\w+\}", (COMPOSE_DIR / "compose.gpu.yaml").read_text()), "a variable without a default"
    assert inline and all(gpu_env[k] == v for k, v in inline.items()), (inline, gpu_env)
    compose = Path(sys.executable).with_name("docker-compose")
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("TESTBED_", "NCCL_", "COMPOSE_"))}
    out = subprocess.run([str(compose), "-f", str(COMPOSE_DIR / "compose.yaml"), "-f", str(COMPOSE_DIR / "compose.gpu.yaml"),
                          "config", "--format", "json"], env=bare, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    plain, ours = json.loads(out.stdout)["services"], _rendered("gpu")["services"]
    for name in ("head", "worker"):
        assert plain[name]["deploy"] == ours[name]["deploy"], name
        assert plain[name]["shm_size"] == ours[name]["shm_size"] and plain[name]["image"] == ours[name]["image"], name
