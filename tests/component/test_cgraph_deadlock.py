"""The compiled-graph raylet deadlock in pure Ray (findings/cgraph-raylet-writeacquire): two executions
in flight, two output channels, zero-copy outputs.

The smallest reproduction of vLLM's compiled-graph logprobs hang (PP=2 x TP=2):
``harness/cgraph_deadlock.py`` (standalone, for Ray maintainers) runs two actors
on one Ray node and the driver on another; rank 1 lags one step. Outputs read
zero-copy with two executions in flight (``upstream``, ``off``: vLLM's engine
keeps PP executions in flight) deadlock the driver node's raylet; the testbed's
fix keeps one in flight (``testbed``) and passes. Each run is a subprocess with
its own two local Ray nodes (loopback), bounded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from vllm_zerocopy_testbed.cluster.process import kill_session
from vllm_zerocopy_testbed.cluster.shm import ShmClaim
from vllm_zerocopy_testbed.config import INFLIGHT_ENV, PatchMode
from vllm_zerocopy_testbed.harness import cgraph_deadlock

pytestmark = [pytest.mark.component, pytest.mark.timeout(240)]

# The deadlocking runs wait this out (three of them per test-core run); a healthy step takes
# ~1 s (rank 1's lag), and the actors' first call has a bound of its own (WARMUP_TIMEOUT_S).
GET_TIMEOUT_S = 5


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    shm = ShmClaim.take()  # what the script's processes leave in /dev/shm, theirs only
    # os._exit and SIGKILL skip multiprocessing's finalizers: each run left a /tmp/pymp-* directory
    # (a listener socket). The script gets a temporary directory of its own, removed below; Ray's
    # session files stay where Ray puts them (RAY_TMPDIR wins over TMPDIR).
    private_tmp = tempfile.mkdtemp(prefix="testbed-deadlock-")
    cmd = [sys.executable, cgraph_deadlock.__file__, "--timeout", str(GET_TIMEOUT_S), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"RAY_TMPDIR": tempfile.gettempdir(), **os.environ, **(env or {}),
                                 "TMPDIR": private_tmp, **shm.env}, start_new_session=True)
    shm.watch(interval=0.5)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        # The script ends with os._exit (a deadlocked graph does not tear down); the Ray
        # processes of its Cluster stay in its session (Ray's agents for ~60 s) and leave
        # their channel semaphores in /dev/shm.
        shm.record()
        left = kill_session(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        shm.remove_new()
        shutil.rmtree(private_tmp, ignore_errors=True)
    assert not left, f"processes of the script's session survived SIGKILL: {left}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.needs_vllm("compiled-graph executor")  # vLLM >= 0.33.0: no executor whose in-flight count to read
def test_the_compiled_graph_never_deadlocks_the_driver_node(inflight_mode, expect) -> None:
    """As many executions in flight as vLLM's engine keeps in this mode: read from a real
    ``VllmConfig`` with the plugins loaded as in the engine (``patches/inflight.py`` under ``testbed``)."""
    expect("cgraph_no_deadlock", inflight_mode)
    proc = _run("--inflight", "vllm", env={INFLIGHT_ENV: inflight_mode.value})
    want = 1 if inflight_mode is PatchMode.TESTBED else 2
    assert f"in flight: {want} " in proc.stdout, (proc.stdout + proc.stderr)[-1500:]
    assert proc.returncode == 0 and "PASS" in proc.stdout, (proc.stdout + proc.stderr)[-1500:]


def test_outputs_that_pickle_in_band_do_not_deadlock() -> None:
    """The same schedule with outputs copied out at deserialization: nothing holds the buffer."""
    proc = _run("--inband")
    assert proc.returncode == 0 and "PASS" in proc.stdout, (proc.stdout + proc.stderr)[-1500:]


def test_the_deadlock_is_bounded_by_the_get_timeout() -> None:
    """Without the fix the driver gets RayChannelTimeoutError after the timeout, not a hang."""
    proc = _run()
    assert proc.returncode == 1 and "DEADLOCK" in proc.stdout and "RayChannelTimeoutError" in proc.stdout, \
        (proc.stdout + proc.stderr)[-1500:]


ONE_NODE = """
import os, ray
os.environ["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "0"
from types import SimpleNamespace
from vllm_zerocopy_testbed.patches import inflight
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")  # a new one-node cluster
try:
    config = SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend="ray", pipeline_parallel_size=2, tensor_parallel_size=2))
    print("needed:", inflight.needed(config))
finally:
    ray.shutdown()
"""


def test_one_ray_node_keeps_vllms_pipelining(tmp_path) -> None:
    """PP x TP compiled graphs on one Ray node have no raylet hop and no deadlock: no cap there."""
    shm = ShmClaim.take()
    # ray.init of a new local cluster writes ~/.ray/auth_token; with that file in the user's home,
    # later `ray start` nodes fail to join (InvalidAuthToken): the subprocess gets a home of its own.
    env = {**os.environ, "HOME": str(tmp_path), **shm.env}
    shm.watch(interval=0.5)
    try:
        proc = subprocess.run([sys.executable, "-c", ONE_NODE], capture_output=True, text=True, timeout=120,
                              env=env)
    finally:
        shm.remove_new()
    assert proc.returncode == 0 and "needed: False" in proc.stdout, (proc.stdout + proc.stderr)[-1500:]
