"""When the torch kernels are used, how the CPU platform gets past 0.34.0's Triton refusal, and
(with 0.34.0 the running vLLM: ``VLLM=0.34.0`` overlay first on the path) that every override
names a real kernel with the same parameters."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

from vllm_zerocopy_testbed import kernels

pytestmark = pytest.mark.unit


def _vllm_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except ImportError:
        return "none"


def _runs_triton_runner_without_triton() -> bool:
    try:
        return kernels.needed()
    except ImportError:
        return False


def test_refusal_is_recognised_by_its_message_only() -> None:
    assert kernels.is_triton_refusal(RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu)."))
    assert not kernels.is_triton_refusal(RuntimeError("something else"))
    assert not kernels.is_triton_refusal(ValueError("vLLM on x86 CPUs requires Triton (triton-cpu)."))


def test_triton_is_presented_for_the_block_only() -> None:
    module = types.ModuleType("fake_triton_utils")
    module.HAS_TRITON = False
    import sys

    sys.modules["fake_triton_utils"] = module
    try:
        with kernels.triton_presented("fake_triton_utils"):
            assert module.HAS_TRITON is True
        assert module.HAS_TRITON is False
        with pytest.raises(KeyError), kernels.triton_presented("fake_triton_utils"):
            raise KeyError("inside")
        assert module.HAS_TRITON is False
    finally:
        del sys.modules["fake_triton_utils"]


def test_unsupported_features_are_named_in_one_line() -> None:
    plain = types.SimpleNamespace(model_config=types.SimpleNamespace(uses_mrope=False, is_hybrid=False),
                                  parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
                                  speculative_config=None)
    assert kernels.unsupported(plain) == []
    kernels.refuse_unsupported(plain)
    spec = types.SimpleNamespace(**{**vars(plain), "speculative_config": object()})
    assert len(kernels.unsupported(spec)) == 1 and "--speculative-config" in kernels.unsupported(spec)[0]
    with pytest.raises(RuntimeError, match="speculative decoding") as refused:
        kernels.refuse_unsupported(spec)
    assert "\n" not in str(refused.value)


def test_next_power_of_2_is_tritons() -> None:
    assert [kernels.next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024,
                                                                                         2048]


@pytest.mark.skipif(_vllm_version() not in ("0.32.0", "0.33.0"), reason="the releases whose behaviour must not change")
def test_releases_before_0_34_use_no_torch_kernels() -> None:
    """0.32.0 has no override hook, 0.33.0's CPU platform registers its own: ours stay out."""
    assert not kernels.needed()
    assert kernels.mode() == ""


@pytest.mark.skipif(not _runs_triton_runner_without_triton(),
                    reason="the running vLLM does not run the Triton runner without Triton (0.34.0 overlay, x86)")
def test_every_override_names_a_kernel_with_the_same_parameters() -> None:
    for name, impl in kernels.overrides().items():
        module_name, attr = name.rsplit(".", 1)
        original = getattr(importlib.import_module(module_name), attr)
        want = [p for p in inspect.signature(getattr(original, "func", original)).parameters]
        got = [p.name for p in inspect.signature(impl.fn).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD][1:]  # after the grid
        assert got == want, name


@pytest.mark.skipif(not _runs_triton_runner_without_triton(),
                    reason="the running vLLM does not run the Triton runner without Triton (0.34.0 overlay, x86)")
def test_platform_passes_the_triton_refusal_and_registers() -> None:
    from vllm_zerocopy_testbed.plugins.cpu_platform_impl import TestbedCpuPlatform

    assert kernels.mode() == kernels.MODE
    TestbedCpuPlatform.register_triton_kernel_overrides()
    gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
    assert gpu_worker.HAS_TRITON is True
    input_batch = importlib.import_module("vllm.v1.worker.gpu.input_batch")
    assert hasattr(input_batch._prepare_pos_seq_lens_kernel, "__getitem__")
