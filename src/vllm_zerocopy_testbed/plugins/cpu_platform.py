"""``vllm.platform_plugins`` entry point: vLLM-CPU with Ray, host-aware shared memory.

Stock vLLM-CPU refuses Ray (``CpuPlatform.ray_device_key`` is empty). Our
platform asks Ray for one ``HPU`` unit per worker: Ray nodes are started with
``--resources='{"HPU": N}'``. ``HPU`` rather than a fake ``GPU`` because Ray's
compiled graphs treat ``GPU`` as CUDA (streams, ``CUDA_VISIBLE_DEVICES``) and
fail on CPU, while the V2 executor accepts either.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from vllm_zerocopy_testbed.config import CommunicatorChoice, TestbedConfig

PLATFORM_QUALNAME = "vllm_zerocopy_testbed.plugins.cpu_platform_impl.TestbedCpuPlatform"


def activate() -> str | None:
    """Return our platform's qualified name on a vLLM-CPU install, else ``None``."""
    if not TestbedConfig.from_env().cpu_platform:
        return None
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return None  # a GPU (or other) build: the builtin platform stays in charge
    return PLATFORM_QUALNAME


def communicator_qualname(config: TestbedConfig) -> str:
    """Return the device communicator class the platform hands to vLLM."""
    if config.communicator is CommunicatorChoice.STOCK:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
    return "vllm_zerocopy_testbed.plugins.host_aware_communicator.HostAwareCpuCommunicator"
