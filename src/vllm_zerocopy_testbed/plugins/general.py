"""``vllm.general_plugins`` entry point: applies the patch modes in every vLLM process."""

from __future__ import annotations

import multiprocessing
import os
import sys

from vllm_zerocopy_testbed import kernels
from vllm_zerocopy_testbed.config import TestbedConfig, ray_address
from vllm_zerocopy_testbed.observe import heap
from vllm_zerocopy_testbed.observe.log import testbed_logger
from vllm_zerocopy_testbed.patches import apply_modes, plant, slowdown, timeline, wiretap
from vllm_zerocopy_testbed.vllm_source import running_line


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
    if config.ray_driver_ip and process_role() == "engine-core":
        _join_ray_as(config.ray_driver_ip)
    role = process_role()
    if role == "engine-core":
        # The engine writes the scheduler's broadcast: tap its sends for the transport checker.
        wiretap.install(testbed_logger(), timeline=config.mq_timeline)
        if config.mq_timeline:
            timeline.install_writer(testbed_logger())
    if config.mq_timeline and role in ("engine-core", "ray-worker", "mp-worker"):
        timeline.install_reader(testbed_logger())
    if role != "other":
        heap.install(role, config.heap_probe_s, trace_frames=config.heap_trace_frames)  # make soak reads it: a leak or the allocator keeping memory
    if config.plant_leak and role in ("ray-worker", "mp-worker"):
        plant.install(config.plant_leak)
    if config.broadcast_fault is not None and role == "engine-core":
        slowdown.install(config.broadcast_fault)
    # A Ray worker names its node: on one machine Ray's own "ip=" log tag is not
    # reliable (nodes share a log directory), and placement is read from this.
    node = f" node={_ray_node_ip()}" if role == "ray-worker" else ""
    traced = " mq-timeline=on" if config.mq_timeline else ""
    # An injected fault is said where the modes are: a slow run never passes for a healthy one.
    fault = f" fault={slowdown.installed()}" if slowdown.installed() else ""
    fault += f" plant={plant.installed()}" if plant.installed() else ""
    # Torch stand-ins for vLLM's Triton kernels (x86 CPUs without triton-cpu): said in every process's
    # line, so no report can pass them off as vLLM's own kernels.
    kernels_mode = _kernels_mode()
    fault += f" kernels={kernels_mode}" if kernels_mode else ""
    # Which vLLM code runs here (an overlay's version@hash, VLLM=): a report can prove it.
    testbed_logger().info("testbed modes pid=%d role=%s %s%s%s%s vllm=%s", os.getpid(), role, modes, node, traced,
                          fault, running_line())


def _kernels_mode() -> str:
    """``torch-overrides`` where this process's vLLM runs the testbed's kernels, else ``""``."""
    try:
        return kernels.mode()
    except Exception:  # a vLLM build whose CPU platform cannot be inspected here: none of ours run
        return ""


def _ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _join_ray_as(node_ip: str) -> None:
    """Connect this engine to Ray as the node at ``node_ip`` before vLLM connects it.

    With Ray nodes on loopback addresses, ``ray.init("auto")`` derives the
    driver's address from the route (127.0.0.1, which Ray rewrites), attaches
    to no node of ours, and vLLM then orders its placement bundles without the
    driver's node first: TP groups can span nodes. vLLM skips its own
    ``ray.init`` when Ray is already initialized.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address(), _node_ip_address=node_ip)
