"""One compiled-graph execution in flight on PP x TP clusters: the testbed's fix for the raylet deadlock
(findings/cgraph-raylet-writeacquire).

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

Its own mode switch, ``TESTBED_INFLIGHT`` (every process's mode line says it):
``testbed`` (default) caps where ``needed``; ``upstream`` and ``off`` keep vLLM's
value (upstream has no fix, so the behaviour before one is vLLM's own). The cap
applies only where the deadlock's conditions hold: the compiled-graph executor,
PP >= 2, TP >= 2, and a Ray cluster of more than one node (the remote outputs
must enter the driver's node through its raylet).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_zerocopy_testbed.config import PatchMode, vllm_uses_compiled_graph
from vllm_zerocopy_testbed.observe.log import testbed_logger

_mode = PatchMode.UPSTREAM  # vLLM's own value until ``apply``


@functools.lru_cache(maxsize=1)
def several_ray_nodes() -> bool:
    """Whether this process's Ray cluster has more than one live node; True while Ray is not
    connected yet (cap rather than risk the deadlock). Asked once per process: the engine
    reads it when its executor has joined Ray."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized():
        return True
    return sum(1 for node in ray.nodes() if node.get("Alive")) > 1


def needed(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs the compiled-graph Ray executor with PP >= 2 and TP >= 2 on
    more than one Ray node: the deadlock's conditions."""
    parallel = vllm_config.parallel_config
    cgraph = vllm_uses_compiled_graph()
    return (parallel.distributed_executor_backend == "ray" and cgraph
            and parallel.pipeline_parallel_size >= 2 and parallel.tensor_parallel_size >= 2
            and several_ray_nodes())


def apply(mode: PatchMode) -> None:
    """Make vLLM's concurrent batches follow ``mode`` in this process (``testbed``: capped where needed)."""
    global _mode
    if mode is PatchMode.TESTBED and not install():
        return  # no VllmConfig here (not a vLLM process): nothing to cap
    _mode = mode


def active_mode() -> PatchMode:
    """Return the mode vLLM's concurrent batches follow in this process."""
    return _mode


def install() -> bool:
    """Wrap ``VllmConfig.max_concurrent_batches`` (once per process): capped at 1 where ``needed``
    while the mode is ``testbed``; return whether the wrapper is in place."""
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
        if value > 1 and _mode is PatchMode.TESTBED and needed(self):
            if not logged:
                logged.append(True)
                testbed_logger().info("testbed cgraph: 1 execution in flight instead of %d (PP x TP "
                                      "compiled graphs deadlock the driver node's raylet)", value)
            return 1
        return value

    patched = property(max_concurrent_batches)
    patched.fget._testbed = True  # type: ignore[attr-defined]
    VllmConfig.max_concurrent_batches = patched  # type: ignore[method-assign]
    return True
