"""``vllm.general_plugins`` entry point: applies the patch modes in every vLLM process."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from vllm_zerocopy_testbed.config import TestbedConfig
from vllm_zerocopy_testbed.patches import apply_modes

logger = logging.getLogger("vllm_zerocopy_testbed")


def process_role() -> str:
    """Return what this process is to vLLM: api-server, engine-core, ray-worker or other."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            return "ray-worker"
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine-core"
    if name.startswith("VllmWorker") or name.startswith("Worker"):
        return "mp-worker"
    if "api_server" in " ".join(sys.argv):
        return "api-server"
    return "other"


def register() -> None:
    """Apply the configured modes; a bad value stops vLLM with a message naming valid ones."""
    config = TestbedConfig.from_env()
    modes = apply_modes(config)
    # vLLM's logger is configured by now; ours propagates to the root logger,
    # which vLLM may not have set up, so log through vLLM's when it is there.
    try:
        from vllm.logger import init_logger

        out = init_logger("vllm_zerocopy_testbed")
    except ImportError:  # pragma: no cover - plugin only loads inside vLLM
        out = logger
    out.info("testbed modes pid=%d role=%s %s", os.getpid(), process_role(), modes)
