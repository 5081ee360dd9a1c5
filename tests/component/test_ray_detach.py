"""vLLM#35319 with real Ray compiled graphs on two loopback nodes.

The actors run on the second node (127.0.0.2) and return real vLLM outputs;
the driver (on the head, 127.0.0.3) reads them through vLLM's own executor
(``RayDistributedExecutor._execute_dag``: the engine's read through ``FutureWrapper``
and the blocking read, step by step in turn) and keeps them all, as the scheduler keeps
logprobs; with two workers (TP), rank 0's output; with a KV connector, every worker's
through vLLM's ``KVOutputAggregator``.
A cluster serves tests until one stalls (or fails): after a stall, Ray's teardown
crashes the remote raylet (``experimental_mutable_object_provider.cc ... Channel
closed``), so the next test gets a fresh one. Reuse saves cluster starts, and a driver run
serves every test that asks for the same run (``off`` logprobs: the stall, and its bound).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_zerocopy_testbed.cluster.local_ray import RayNodeSpec, ReusedCluster
from vllm_zerocopy_testbed.config import PatchMode

# vLLM's FutureWrapper and detach live in its compiled-graph executor: gone since 0.33.0.
pytestmark = [pytest.mark.component, pytest.mark.timeout(300), pytest.mark.needs_vllm("compiled-graph executor")]

STEPS = 20
STEP_TIMEOUT_S = 5  # the short RAY_CGRAPH_get_timeout a stall runs into
REMOTE = "testbed_node1"


@pytest.fixture(scope="module")
def two_nodes():
    """The module's cluster, started by the first driver run that needs it."""
    nodes = ReusedCluster([RayNodeSpec("127.0.0.3"), RayNodeSpec("127.0.0.2", resources={REMOTE: 1})])
    try:
        yield nodes
    finally:
        nodes.stop()


# Each driver run's steps, by its arguments: a test that asks for a run already made judges that
# run (a run is ~9 s, and one that stalls costs the next test a cluster start, ~10 s).
_RUNS: dict[tuple[str, ...], list[dict]] = {}


def _drive(nodes: ReusedCluster, mode: PatchMode, *extra: str) -> list[dict]:
    """The driver's steps against ``nodes``' cluster (run once per arguments); a run that did not
    complete every step marks the cluster spent."""
    key = (mode.value, *extra)
    if key in _RUNS:
        return _RUNS[key]
    cluster = nodes.get()
    env = dict(os.environ, RAY_CGRAPH_teardown_timeout="10", RAY_CGRAPH_get_timeout=str(STEP_TIMEOUT_S))
    cmd = [sys.executable, "-m", "vllm_zerocopy_testbed.harness.ray_channel",
           f"--address={cluster.address}", "--node-ip=127.0.0.3", f"--mode={mode.value}",
           f"--steps={STEPS}", f"--node-resource={REMOTE}", f"--step-timeout={STEP_TIMEOUT_S}", *extra]
    nodes.spent = True  # until the driver reports every step done
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"driver printed no history (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    steps = json.loads(lines[-1])["steps"]
    nodes.spent = proc.returncode != 0 or any(step["error"] for step in steps)
    _RUNS[key] = steps
    return steps


def _assert_no_stall(steps: list[dict]) -> None:
    failed = [s for s in steps if s["error"]]
    assert not failed, (
        f"step {failed[0]['step']} ended with {failed[0]['error']} after {failed[0]['seconds']:.1f} s "
        f"while earlier outputs were held"
    )
    assert len(steps) == STEPS


def test_held_logprobs_never_stall_the_channel(two_nodes, detach_mode, expect) -> None:
    expect("detach_logprobs", detach_mode)
    _assert_no_stall(_drive(two_nodes, detach_mode))


def test_held_sampling_masks_never_stall_the_channel(two_nodes, detach_mode, expect) -> None:
    from vllm_zerocopy_testbed.harness.ray_channel import has_sampling_masks

    if not has_sampling_masks():
        pytest.skip("this vLLM's ModelRunnerOutput has no sampling_masks")
    expect("detach_sampling_mask", detach_mode)
    _assert_no_stall(_drive(two_nodes, detach_mode, "--sampling-mask"))


def test_every_worker_output_is_detached_before_the_kv_aggregator_merges_them(two_nodes, detach_mode, expect) -> None:
    """vLLM's executor with a KV connector reads every worker's output, detaches each and lets
    ``KVOutputAggregator`` merge them into rank 0's: the scheduler keeps that output, so a held
    array of it must not stall the next step, and what it gets is rank 0's tokens with both
    workers' finished KV sends counted."""
    expect("detach_logprobs", detach_mode)
    _assert_no_stall(_drive(two_nodes, detach_mode, "--workers=2", "--kv-connector"))


def test_only_the_output_rank_s_output_reaches_the_scheduler(two_nodes, detach_mode, expect) -> None:
    """Two workers of the last stage (TP=2) without a KV connector: vLLM's executor reads rank 0's
    output alone (each worker marks its tokens with its rank) and detaches it, in both reads."""
    expect("detach_logprobs", detach_mode)
    _assert_no_stall(_drive(two_nodes, detach_mode, "--workers=2"))


def test_a_stall_is_bounded_by_the_channel_timeout(two_nodes) -> None:
    """The fix-off run shows the real symptom, within its bound (not a hang)."""
    steps = _drive(two_nodes, PatchMode.OFF)
    assert [s["error"] for s in steps] == [None, "RayChannelTimeoutError"]
    assert steps[1]["seconds"] < STEP_TIMEOUT_S + 2.0
