"""A frozen remote reader never holds the writer past vLLM's step timeout.

vLLM's executors call ``enqueue`` with ``timeout=None``. Upstream's racy send returns at
once (the message waits in ZMQ's pipe) and the RPC fails after
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``; the testbed's send waits for ZMQ's release, so
with a stopped reader and a message larger than the socket buffers it must end by the
same bound, with an error that names the readers and does not look retryable.
"""

from __future__ import annotations

import time

import pytest
import torch

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import MessageQueueHarness, QueueTopology
from vllm_zerocopy_testbed.patches.broadcast import SendNotReleased

pytestmark = pytest.mark.component

STEP_TIMEOUT_S = 3


def test_a_stopped_reader_ends_enqueue_within_the_step_timeout(broadcast_mode, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_TIMEOUT_S))
    tensor = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB, far past the socket buffers
    with MessageQueueHarness(QueueTopology(local_readers=0, remote_readers=1), broadcast_mode) as harness:
        harness.pause_readers()
        try:
            started = time.monotonic()
            outcome: BaseException | None = None
            try:
                harness.writer.enqueue({"x": tensor}, timeout=None)  # as vLLM's collective_rpc calls it
            except SendNotReleased as exc:
                outcome = exc
            took = time.monotonic() - started
        finally:
            harness.resume_readers()
        harness.collect()  # the message still reaches the reader once it runs again
    print(f"{broadcast_mode.value}: enqueue with a stopped reader ended after {took:.2f} s ({outcome!r})")
    if broadcast_mode is PatchMode.TESTBED:
        assert isinstance(outcome, SendNotReleased), f"returned after {took:.1f} s without the release"
        assert STEP_TIMEOUT_S <= took < STEP_TIMEOUT_S + 5, f"ended after {took:.1f} s, bound {STEP_TIMEOUT_S} s"
        assert "1 remote reader(s) of tcp://" in str(outcome) and "do not retry" in str(outcome)
    else:  # no hold: the send returns at once and the bytes wait in ZMQ (racy, but never blocked)
        assert outcome is None and took < STEP_TIMEOUT_S, f"{broadcast_mode.value} took {took:.1f} s"
