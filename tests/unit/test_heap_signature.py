"""The heap probe's count of context variables: the signature of the known ContextVar leak,
read from another thread than the one that leaks (the probe's)."""

from __future__ import annotations

import contextvars
import threading

import pytest

from vllm_zerocopy_testbed.config import ConfigError, TestbedConfig
from vllm_zerocopy_testbed.node import heap

pytestmark = pytest.mark.unit


def test_the_count_sees_variables_another_thread_keeps_in_its_context() -> None:
    count = heap.ContextVarCount(rescan=1)
    before = count()
    kept, done = threading.Event(), threading.Event()

    def leak() -> None:  # what torch's config.patch() does once per forward: a new variable, set
        for i in range(before + 500):
            contextvars.ContextVar(f"leak{i}").set(i)
        kept.set()
        done.wait(30)

    thread = threading.Thread(target=leak)
    thread.start()
    try:
        assert kept.wait(30)
        assert count() >= before + 500
    finally:
        done.set()
        thread.join(30)
    assert "context_vars" in heap.read()


def test_a_planted_leak_is_checked_like_every_other_setting() -> None:
    assert TestbedConfig.from_env({"TESTBED_PLANT_LEAK": "outputs"}).plant_leak == "outputs"
    assert TestbedConfig.from_env({}).plant_leak == ""
    with pytest.raises(ConfigError, match="TESTBED_PLANT_LEAK='everything' is invalid; use outputs or nothing"):
        TestbedConfig.from_env({"TESTBED_PLANT_LEAK": "everything"})
