"""Configuration from the environment: defaults, and errors that name the valid values."""

from __future__ import annotations

import time

import pytest

from vllm_zerocopy_testbed import config
from vllm_zerocopy_testbed.config import CommunicatorChoice, ConfigError, PatchMode, TestbedConfig

pytestmark = pytest.mark.unit


def test_defaults_are_ours() -> None:
    config = TestbedConfig.from_env({})
    assert config.broadcast is PatchMode.TESTBED and config.detach is PatchMode.TESTBED
    assert config.inflight is PatchMode.TESTBED and config.arena is PatchMode.TESTBED
    assert config.communicator is CommunicatorChoice.HOST_AWARE and config.ray_device_key == "HPU"


def test_modes_parse_case_insensitively() -> None:
    config = TestbedConfig.from_env({"TESTBED_BROADCAST": "OFF", "TESTBED_DETACH": " upstream "})
    assert (config.broadcast, config.detach) == (PatchMode.OFF, PatchMode.UPSTREAM)


@pytest.mark.parametrize(
    "env, names",
    [
        ({"TESTBED_BROADCAST": "on"}, ["TESTBED_BROADCAST", "upstream", "off", "testbed"]),
        ({"TESTBED_DETACH": "yes"}, ["TESTBED_DETACH", "upstream", "off", "testbed"]),
        ({"TESTBED_INFLIGHT": "1"}, ["TESTBED_INFLIGHT", "upstream", "off", "testbed"]),
        ({"TESTBED_ARENA": "on"}, ["TESTBED_ARENA", "upstream", "off", "testbed"]),
        ({"TESTBED_CPU_COMMUNICATOR": "shm"}, ["host-aware", "stock"]),
        ({"TESTBED_RAY_DEVICE_KEY": "TPU"}, ["HPU", "GPU"]),
    ],
)
def test_bad_values_name_the_valid_ones(env, names) -> None:
    with pytest.raises(ConfigError) as info:
        TestbedConfig.from_env(env)
    for name in names:
        assert name in str(info.value)


def test_cluster_backend_is_one_knob() -> None:
    from vllm_zerocopy_testbed.host_config import cluster_backend

    assert cluster_backend({}) == "compose" and cluster_backend({"TESTBED_CLUSTER": "local"}) == "local"
    with pytest.raises(ConfigError, match="compose, local"):
        cluster_backend({"TESTBED_CLUSTER": "k8s"})


def test_broadcast_fault_parses_a_stall_and_names_valid_values() -> None:
    from vllm_zerocopy_testbed.config import FAULT_BROADCAST_ENV, BroadcastFault, ConfigError, TestbedConfig

    assert TestbedConfig.from_env({}).broadcast_fault is None
    assert TestbedConfig.from_env({FAULT_BROADCAST_ENV: "stall:10"}).broadcast_fault == BroadcastFault("stall", 10.0)
    assert str(BroadcastFault.parse(" Stall:7.5 ")) == "stall:7.5"
    for bad in ("stall", "stall:-1", "stall:0", "slow:2", "stall:x"):
        with pytest.raises(ConfigError, match=r"use stall:S \(S seconds > 0\) or nothing"):
            BroadcastFault.parse(bad)


def test_the_e2e_run_settings_are_read_once_with_one_default_each() -> None:
    from vllm_zerocopy_testbed.config import REPO_ROOT, ConfigError
    from vllm_zerocopy_testbed.host_config import ClusterSettings, E2ERun

    settings = ClusterSettings.from_env({"RAY_CGRAPH_get_timeout": "30"})
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(0))
    run = E2ERun.from_env(settings, {}, started=stamp)
    assert run.report_dir == REPO_ROOT / f"reports/e2e-{stamp}"
    assert run.request_timeout_s == 90.0, "the channel timeout + 60 s: a stall ends as the server's error"
    assert run.latency_budget == 30.0
    run = E2ERun.from_env(settings, {"TESTBED_REPORT_DIR": "reports/x", "TESTBED_REQUEST_TIMEOUT_S": "12",
                                     "TESTBED_LATENCY_BUDGET": "4.5"})
    assert (run.report_dir, run.request_timeout_s, run.latency_budget) == (REPO_ROOT / "reports/x", 12.0, 4.5)
    for name, bad in (("TESTBED_LATENCY_BUDGET", "fast"), ("TESTBED_REQUEST_TIMEOUT_S", "0"),
                      ("TESTBED_REQUEST_TIMEOUT_S", "-3")):
        with pytest.raises(ConfigError, match=f"{name}='{bad}' is invalid"):
            E2ERun.from_env(settings, {name: bad})


def test_child_processes_run_ray_without_token_auth_unless_the_user_says(monkeypatch) -> None:
    """A ~/.ray/auth_token left by any local ray.init() must not make the testbed's nodes refuse
    to join (InvalidAuthToken): children get RAY_AUTH_MODE=disabled, and a user's own value wins."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert config.process_env()["RAY_AUTH_MODE"] == "disabled"
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert config.process_env()["RAY_AUTH_MODE"] == "token"
    assert config.process_env(RAY_AUTH_MODE="x")["RAY_AUTH_MODE"] == "x"
