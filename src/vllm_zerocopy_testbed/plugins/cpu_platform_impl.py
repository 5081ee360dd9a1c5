"""The platform class; imported by vLLM only after ``cpu_platform.activate`` chose it."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

from vllm_zerocopy_testbed.config import TestbedConfig
from vllm_zerocopy_testbed.plugins.cpu_platform import communicator_qualname

_CONFIG = TestbedConfig.from_env()


class TestbedCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, schedulable by Ray, with the host-aware communicator."""

    ray_device_key: str = _CONFIG.ray_device_key
    # Ray must not narrow device visibility for the fake accelerator units.
    ray_noset_device_env_vars = [
        "RAY_EXPERIMENTAL_NOSET_HABANA_VISIBLE_MODULES",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    ]

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return communicator_qualname(_CONFIG)
