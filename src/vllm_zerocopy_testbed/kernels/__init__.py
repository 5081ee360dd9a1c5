"""Torch stand-ins for the Triton kernels on vLLM's serving path, for x86 CPUs without triton-cpu.

From 0.34.0 vLLM's x86 CPU platform runs the Triton-based model runner (``CPUModelRunner``, a
``GPUModelRunner``) and refuses to start without triton-cpu, which comes from GitHub releases
only. vLLM's own hook for such platforms, ``Platform.register_triton_kernel_overrides`` with
``vllm.triton_utils.dispatcher.register_kernels``, takes plain callables: this package supplies
torch implementations of the kernels a request runs through, one module per kernel family, each
written from its Triton source. Releases whose CPU platform brings its own overrides (0.33.0)
or needs none (0.32.0) are left as they are: ``needed`` says no there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

MODE = "torch-overrides"
# The message of CpuPlatform.check_and_update_config's refusal (platforms/cpu.py, 0.34.0).
_REFUSAL = "requires Triton (triton-cpu)"
# kernel family module -> its overrides (``OVERRIDES`` in each)
_FAMILIES = (
    "input_batch",
    "block_table",
    "buffer_utils",
    "sampling",
    "penalties",
    "logits_processors",
    "logprob",
    "structured_outputs",
    "prompt_embeds",
)
_registered: list[str] = []


def is_triton_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is the CPU platform's refusal to start on x86 without triton-cpu."""
    return isinstance(exc, RuntimeError) and _REFUSAL in str(exc)


@contextlib.contextmanager
def triton_presented(*module_names: str) -> Iterator[None]:
    """Let ``HAS_TRITON`` read True in the named modules for the block only (for one check)."""
    modules = [importlib.import_module(name) for name in module_names]
    saved = [module.HAS_TRITON for module in modules]
    for module in modules:
        module.HAS_TRITON = True
    try:
        yield
    finally:
        for module, value in zip(modules, saved):
            module.HAS_TRITON = value


def needed() -> bool:
    """Whether this process's vLLM needs the overrides: x86, no usable Triton, the kernel-override
    hook, and a CPU platform that registers no overrides of its own."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum, Platform

    if not hasattr(Platform, "register_triton_kernel_overrides"):
        return False  # before the hook (0.32.0)
    if any("register_triton_kernel_overrides" in vars(cls) for cls in CpuPlatform.__mro__ if cls is not Platform):
        return False  # the CPU platform brings its own (0.33.0)
    if CpuPlatform.get_cpu_architecture() != CpuArchEnum.X86:
        return False  # other CPUs have vLLM's standalone no-Triton runner
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON


def unsupported(vllm_config: Any) -> list[str]:
    """What this configuration turns on that needs a Triton kernel without a torch one here: one
    phrase each (the option that turns it on, and what is missing). Checked at start, so a server
    refuses it there instead of failing, or answering wrong, on the first request that runs it."""
    model = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    reasoning = getattr(vllm_config, "reasoning_config", None)
    found = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        found.append("speculative decoding (--speculative-config): its draft and verify kernels")
    if parallel is not None and max(getattr(parallel, "decode_context_parallel_size", 1),
                                    getattr(parallel, "prefill_context_parallel_size", 1)) > 1:
        found.append("context parallelism (--decode/--prefill-context-parallel-size): its slot-mapping kernels")
    if getattr(vllm_config, "watermark_config", None) is not None:
        found.append("watermarking (--watermark-config): its Philox sampling kernels")
    if model is not None and getattr(model, "enable_trace_replay", False):
        found.append("trace replay (--enable-trace-replay): its replay kernels")
    if model is not None and getattr(model, "return_sampling_mask", False):
        found.append("sampling masks (--return-sampling-mask): its mask compaction kernel")
    if model is not None and getattr(model, "uses_mrope", False):
        found.append("M-RoPE models (multimodal positions): the rope position kernel")
    if model is not None and getattr(model, "is_hybrid", False):
        found.append("hybrid Mamba models: the state bookkeeping kernels")
    if reasoning is not None and all(getattr(reasoning, name, None) for name in (
            "reasoning_start_token_ids", "reasoning_end_token_ids", "natural_reasoning_end_token_ids")):
        found.append("thinking budgets (reasoning config, request thinking_token_budget): the budget kernels")
    if os.environ.get("VLLM_COMPUTE_NANS_IN_LOGITS", "0").lower() not in ("0", "false", ""):
        found.append("VLLM_COMPUTE_NANS_IN_LOGITS: the NaN-count kernel")
    return found


def refuse_unsupported(vllm_config: Any) -> None:
    """Raise, with one line, where the configuration needs a kernel this package does not have."""
    missing = unsupported(vllm_config)
    if missing:
        raise RuntimeError("vLLM on x86 without triton-cpu runs the testbed's torch kernels, which lack: "
                           + "; ".join(missing) + " (install triton-cpu, or turn these off)")


def overrides() -> dict[str, Callable[..., Any]]:
    """Every override this package has: vLLM kernel name -> torch implementation."""
    found: dict[str, Callable[..., Any]] = {}
    for family in _FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
        found.update(module.OVERRIDES)
    return found


def register() -> list[str]:
    """Register the overrides with vLLM's dispatcher and let its worker pass the Triton check;
    return the kernel names. Once per process."""
    if _registered:
        return list(_registered)
    from vllm.triton_utils.dispatcher import register_kernels

    table = overrides()
    register_kernels(table)
    # The worker refuses to build the Triton-based runner without Triton (gpu_worker.Worker):
    # its kernels are now ours. The module reads the flag once, at import.
    importlib.import_module("vllm.v1.worker.gpu_worker").HAS_TRITON = True
    # The launch sites size blocks with triton.next_power_of_2, which vLLM's placeholder for a
    # missing Triton lacks (it has cdiv): the same host helper, for the placeholder only.
    placeholder = importlib.import_module("vllm.triton_utils").triton
    if not hasattr(placeholder, "next_power_of_2"):
        placeholder.next_power_of_2 = next_power_of_2
    # What vLLM's CPU shim (v1/worker/cpu/shm.py) does for the Triton runner when it has Triton:
    # host buffers stand in for CUDA's unified-memory ones (pinned memory does not exist here).
    gpu_buffers = importlib.import_module("vllm.v1.worker.gpu.buffer_utils")
    gpu_buffers.UvaBuffer = importlib.import_module("vllm.v1.worker.cpu.buffer_utils").UvaBuffer
    _registered.extend(sorted(table))
    from vllm_zerocopy_testbed.observe.log import testbed_logger

    testbed_logger().info("testbed kernels pid=%d kernels=%s (%d Triton kernels replaced by torch ones)", os.getpid(),
                          MODE, len(table))
    return list(_registered)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (1 for ``n`` <= 1): ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def mode() -> str:
    """``torch-overrides`` where this process registered the overrides or will (its vLLM needs them:
    ``needed``), else ``""``: for the per-process mode line, which a worker writes before vLLM
    calls the registration hook."""
    if _registered:
        return MODE
    try:
        return MODE if needed() else ""
    except ImportError:  # no vLLM, or one without a CPU platform
        return ""
