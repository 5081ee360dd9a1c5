"""The heap probe's count of context variables: the signature of the known ContextVar leak,
read from another thread than the one that leaks (the probe's)."""

from __future__ import annotations

import contextvars
import threading

import pytest

from vllm_zerocopy_testbed.config import ConfigError, TestbedConfig
from vllm_zerocopy_testbed.observe import heap

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


def test_the_onednn_cache_is_counted_from_the_creation_lines_a_process_logs(tmp_path) -> None:
    import os
    import subprocess
    import sys
    import time

    from vllm_zerocopy_testbed.node import usage

    lines = "onednn_verbose,v1,primitive,create:cache_miss,cpu,matmul\n" * 5 + "create:cache_hit\n"
    program = f"import sys, time; sys.stdout.write({lines!r}); sys.stdout.flush(); time.sleep(30)"
    started = []
    try:
        for capacity in ("", "3"):
            env = {**os.environ, "ONEDNN_VERBOSE": "profile_create", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity}
            out = (tmp_path / f"worker{capacity}.out").open("w")
            started.append(subprocess.Popen([sys.executable, "-c", program], stdout=out, env=env))
        quiet = subprocess.Popen([sys.executable, "-c", program], stdout=(tmp_path / "quiet.out").open("w"))
        started.append(quiet)
        deadline = time.monotonic() + 30  # until every process has written its lines (bounded)
        while time.monotonic() < deadline and not all(
                (tmp_path / name).read_text().count("\n") == 6 for name in ("worker.out", "worker3.out", "quiet.out")):
            time.sleep(0.1)
        assert usage.onednn_cached([started[0].pid]) == {"onednn_cached": 5.0}
        assert usage.onednn_cached([p.pid for p in started]) == {"onednn_cached": 8.0}, "5, and 3 at its capacity"
        assert usage.onednn_cached([quiet.pid]) == {}, "a process that does not log them has no figure"
    finally:
        for process in started:
            process.kill()
            process.wait(10)
