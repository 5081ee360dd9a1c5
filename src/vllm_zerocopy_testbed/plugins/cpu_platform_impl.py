"""The platform class; imported by vLLM only after ``cpu_platform.activate`` chose it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms.cpu import CpuPlatform

from vllm_zerocopy_testbed import kernels
from vllm_zerocopy_testbed.config import TestbedConfig
from vllm_zerocopy_testbed.plugins.cpu_platform import communicator_qualname

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """vLLM's config checks; where the CPU platform refuses x86 without triton-cpu (0.34.0 on),
        the same checks past that refusal: the kernels it wants come from ``kernels``."""
        try:
            super().check_and_update_config(vllm_config)
        except RuntimeError as exc:
            # Raised before the method changes anything: run it again with Triton presented.
            if not kernels.is_triton_refusal(exc):
                raise
            with kernels.triton_presented("vllm.triton_utils"):
                super().check_and_update_config(vllm_config)
            kernels.refuse_unsupported(vllm_config)

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """vLLM's overrides, then ours where the CPU platform needs Triton and has none here."""
        parent = getattr(super(), "register_triton_kernel_overrides", None)
        if parent is not None:
            parent()
        if kernels.needed():
            kernels.register()
