"""The MessageQueue failures users reported upstream, on the vLLM under test: one test per report.

* upstream vLLM report 50398: two threads dequeuing from one reader's queue read the same slot
  (every release 0.26.0-0.34.0; the testbed's mode serializes ``dequeue``);
* upstream vLLM report 50960: the remote port is picked with ``get_open_port()`` and bound later,
  so another socket can take it in between (0.26.0 and 0.27.0; from 0.28.0 the queue binds ``:0``).
"""

from __future__ import annotations

import inspect
import socket
import time
from collections import Counter
from typing import Any

import pytest
import torch
import zmq

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import (
    THREAD_ERRORS,
    THREAD_READS,
    MessageQueueHarness,
    QueueTopology,
)

pytestmark = [pytest.mark.component]

# Small messages: the ring path, where both threads share the reader's cursor. A small ring
# (10 chunks of 64 KiB) keeps the test's /dev/shm and page reservation small.
CONCURRENT = QueueTopology(local_readers=1, max_chunk_bytes=64 * 1024)
RING_CHUNKS = 10  # vLLM's default max_chunks, which the harness keeps
# The window, made likely rather than waited for: both threads wait on an empty ring; the writer
# sends a burst longer than the ring while the thread that got its first message is busy with it
# (READER_WORK_S), so the other thread, still bound to that first slot, sees it written again.
BURST = RING_CHUNKS + 2
BURSTS = 20
READER_WORK_S = 0.02
DRAIN_S = BURST * READER_WORK_S  # one thread alone drains a burst in this time
IDLE_S = 3.0  # a reader thread with nothing to read this long ends; so does a blocked enqueue
MESSAGES = BURST * BURSTS


def _message(index: int) -> dict[str, Any]:
    """Message ``index``: its number and a body derived from it, so a torn read shows."""
    return {"index": index, "body": index.to_bytes(4, "big") * 64}


def _verdict(sent: int, blocked: bool, reads: list[tuple[int, Any]], errors: list[str]) -> str | None:
    """Return what went wrong with the threads' reads of messages ``0..sent-1``, or None."""
    counts = Counter(message["index"] for _, message in reads)
    repeated = {index: n for index, n in counts.items() if n > 1}
    lost = sorted(set(range(sent)) - set(counts))
    torn = [message["index"] for _, message in reads if message["body"] != _message(message["index"])["body"]]
    if not (repeated or lost or torn or errors or blocked):
        return None
    by_thread = Counter(thread for thread, _ in reads)
    return (f"two threads dequeuing from one MessageQueue got {len(repeated)} message(s) more than once "
            f"(first: {sorted(repeated.items())[:5]}), lost {len(lost)} (first: {lost[:5]}), {len(torn)} torn, "
            f"read errors {errors[:3]}; writer {'blocked' if blocked else 'not blocked'} after {sent} of "
            f"{MESSAGES}; reads per thread {dict(by_thread)}")


@pytest.mark.timeout(120)
def test_two_threads_dequeue_each_message_once(broadcast_mode: PatchMode, expect) -> None:
    """A reader's threads share its queue: each message is dequeued by exactly one of them, whole."""
    expect("single_consumer_dequeue", broadcast_mode)
    blocked = False
    sent = 0
    with MessageQueueHarness(CONCURRENT, broadcast_mode, timeout=IDLE_S, reader_threads=2,
                             delays={1: READER_WORK_S}) as harness:
        try:
            for _ in range(BURSTS):
                for _ in range(BURST):
                    harness.send(_message(sent))
                    sent += 1
                time.sleep(DRAIN_S)  # both threads end up waiting on the empty ring
        except TimeoutError:
            blocked = True  # the reader stopped freeing slots
        report = harness.thread_reads()[1]
    problem = _verdict(sent, blocked, report[THREAD_READS], report[THREAD_ERRORS])
    assert problem is None, problem


def _picks_port_before_bind() -> bool:
    """Whether the vLLM under test picks its remote port with ``get_open_port()`` and binds it later."""
    from vllm.distributed.device_communicators import shm_broadcast

    return "get_open_port(" in inspect.getsource(shm_broadcast.MessageQueue.__init__)


@pytest.mark.timeout(60)
def test_remote_port_is_bound_where_it_is_picked(monkeypatch: pytest.MonkeyPatch, expect) -> None:
    """Another socket that takes the picked port before the bind (a busy host) cannot fail the start.

    The window is made certain rather than waited for: the port picker hands out a port and a
    listener takes it at once. A queue that binds ``:0`` and reads back its endpoint never asks.
    The broadcast mode does not touch this path: the test runs vLLM's own constructor.
    """
    if _picks_port_before_bind():
        expect("remote_port_bound_at_pick", PatchMode.UPSTREAM)
    from vllm.distributed.device_communicators import shm_broadcast

    topology = QueueTopology(local_readers=0, remote_readers=1)
    squatters: list[socket.socket] = []
    if hasattr(shm_broadcast, "get_open_port"):
        picker = shm_broadcast.get_open_port

        def pick_then_lose() -> int:
            port = picker()
            squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            squatter.bind((topology.remote_ip, port))
            squatter.listen()
            squatters.append(squatter)
            return port

        monkeypatch.setattr(shm_broadcast, "get_open_port", pick_then_lose)
    # A constructor that raises leaves its ZMQ context with open sockets, and the interpreter's exit
    # then waits on it for good: the contexts it made are destroyed here instead.
    contexts: list[zmq.Context] = []

    def recorded_context(*args: Any, **kwargs: Any) -> zmq.Context:
        contexts.append(zmq.Context(*args, **kwargs))
        return contexts[-1]

    monkeypatch.setattr(shm_broadcast, "Context", recorded_context)
    try:
        with MessageQueueHarness(topology, PatchMode.UPSTREAM, timeout=20) as harness:
            payload = {"ids": torch.arange(16)}
            reports = harness.broadcast(payload)
    except zmq.ZMQError as exc:
        for context in contexts:
            context.destroy(linger=0)
        pytest.fail(f"MessageQueue could not bind the remote port it picked ({len(squatters)} taken in between): "
                    f"{exc}")
    finally:
        for squatter in squatters:
            squatter.close()
    assert list(reports) == [1], f"the remote reader did not answer: {reports}"
