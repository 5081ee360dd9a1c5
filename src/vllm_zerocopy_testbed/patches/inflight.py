"""One compiled-graph execution in flight on PP x TP clusters: the testbed's fix for issue 5.

The cause (docs/cgraph-logprobs-hang.md): with PP >= 2 vLLM's engine keeps PP
executions in flight (its batch queue), and with TP >= 2 the driver reads one
output channel per last-stage rank. Remote outputs enter the driver's node
through its raylet, which applies each write on its main thread with a
``WriteAcquire`` that waits, without a timeout, until the driver released the
channel's previous value. Once the driver holds rank 0's output of step N while
it waits for rank 1's output of N, and rank 0's output of N+1 arrives first,
the raylet blocks for ever and rank 1's output waits behind it: a deadlock,
reproduced in pure Ray by ``harness/cgraph_deadlock.py``. The first logprobs
request triggers it in vLLM (the ranks fall out of step while both compile the
logprobs op); with one execution in flight N+1 cannot exist before N is read.

Cost: no overlap of the two PP stages' work between steps (the V2 executor,
vLLM's default, is unaffected). Outputs do not change: the same batches run,
one after the other.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_zerocopy_testbed.plugins.log import testbed_logger


def needed(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs the compiled-graph Ray executor with PP >= 2 and TP >= 2."""
    parallel = vllm_config.parallel_config
    cgraph = os.environ.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1").strip() in ("0", "false", "False")
    return (parallel.distributed_executor_backend == "ray" and cgraph
            and parallel.pipeline_parallel_size >= 2 and parallel.tensor_parallel_size >= 2)


def install() -> bool:
    """Cap vLLM's concurrent batches at 1 where ``needed`` (this process); return whether it patched."""
    try:
        from vllm.config.vllm import VllmConfig
    except ImportError:
        return False
    original = VllmConfig.max_concurrent_batches
    if getattr(original.fget, "_testbed", False):
        return True
    logged: list[bool] = []

    def max_concurrent_batches(self: Any) -> int:
        value = original.fget(self)
        if value > 1 and needed(self):
            if not logged:
                logged.append(True)
                testbed_logger().info("testbed cgraph: 1 execution in flight instead of %d (issue 5: PP x TP "
                                      "compiled graphs deadlock the driver node's raylet)", value)
            return 1
        return value

    patched = property(max_concurrent_batches)
    patched.fget._testbed = True  # type: ignore[attr-defined]
    VllmConfig.max_concurrent_batches = patched  # type: ignore[method-assign]
    return True
