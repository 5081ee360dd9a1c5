"""Configuration from the environment: defaults, and errors that name the valid values."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.config import CommunicatorChoice, ConfigError, PatchMode, TestbedConfig

pytestmark = pytest.mark.unit


def test_defaults_are_ours() -> None:
    config = TestbedConfig.from_env({})
    assert config.broadcast is PatchMode.TESTBED and config.detach is PatchMode.TESTBED
    assert config.inflight is PatchMode.TESTBED
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
    from vllm_zerocopy_testbed.config import cluster_backend

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
