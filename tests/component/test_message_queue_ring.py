"""vLLM's MessageQueue ring protocol: slots reused many times over, the overflow boundary, bounded reads.

The ring has ``max_chunks`` slots (10); each slot is written again once every reader
marked it read. These tests send several laps of messages, size messages byte by byte
around the chunk size (where a message stops fitting and must overflow to ZMQ), and read
with nothing sent, in every broadcast mode (the reader side is vLLM's code in each).
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.harness.message_queue import (LONG_WAITS, READ_ERROR, WAITED_S, MessageQueueHarness,
                                                         QueueTopology, describe)

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]

MiB = 1 << 20
LAPS = 3
MAX_CHUNKS = 10  # MessageQueue's default


def _message(index: int) -> dict:
    gen = torch.Generator().manual_seed(index)
    return {"array": np.random.default_rng(index).standard_normal(3 * MiB // 8 + index).astype(np.float32),
            "tensor": torch.randn(MiB // 4 + index, generator=gen)}


def test_what_readers_keep_survives_the_reuse_of_its_ring_slot(broadcast_mode) -> None:
    """Readers keep every message (arrays and tensors of 1.5 and 1 MiB, out of band) while the
    writer goes round the ring three times; what they kept must still be what was sent."""
    topology = QueueTopology(local_readers=2, max_chunk_bytes=4 * MiB)
    sent = [_message(i) for i in range(LAPS * MAX_CHUNKS)]
    with MessageQueueHarness(topology, broadcast_mode, timeout=20, keep=True) as harness:
        for index, payload in enumerate(sent):
            reports = harness.broadcast(payload)
            for rank, report in reports.items():
                assert READ_ERROR not in report, f"reader {rank}, message {index}: {report[READ_ERROR]}"
                assert report == describe(payload), f"reader {rank} got different bytes in message {index}"
        kept = harness.recheck()
    expected = {f"{i}/{name}": item.digest for i, p in enumerate(sent) for name, item in describe(p).items()}
    for rank, report in kept.items():
        changed = sorted(key for key, item in report.items() if item.digest != expected[key])
        assert not changed, f"reader {rank}: kept items changed after their ring slot was reused: {changed[:6]}"


def _blob_of_stream_size(size: int) -> dict:
    """A message whose pickle stream is exactly ``size`` bytes, all in band (``bytes`` never leave it)."""
    overhead = len(pickle.dumps({"blob": bytes(size)}, protocol=pickle.HIGHEST_PROTOCOL)) - size
    payload = {"blob": np.random.default_rng(size).bytes(size - overhead)}
    assert len(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)) == size
    return payload


def test_messages_around_the_chunk_size_fit_the_ring_or_overflow(broadcast_mode) -> None:
    """Every stream size from 40 bytes under the chunk size to 8 over it: a slot holds 3 header
    bytes, 4 length bytes and the stream; one byte more must overflow to the socket instead."""
    topology = QueueTopology(local_readers=1, max_chunk_bytes=MiB)
    with MessageQueueHarness(topology, broadcast_mode, timeout=20) as harness:
        for size in range(MiB - 40, MiB + 8):
            payload = _blob_of_stream_size(size)
            try:
                reports = harness.broadcast(payload)
            except (ValueError, IndexError) as exc:
                pytest.fail(f"a {size}-byte stream (chunk {MiB}) broke enqueue: {type(exc).__name__}: {exc}")
            assert reports[1] == describe(payload), f"a {size}-byte stream (chunk {MiB}) arrived different"


def test_a_slot_that_carried_an_overflow_carries_a_message_that_fits_next(broadcast_mode) -> None:
    """A slot's first byte says whether its message went to the overflow socket; the writer sets it
    for every message, since the slot keeps what its last message wrote. Two slots, each written
    overflow, fits, overflow, fits in turn: a reader that found the last overflow's mark on a message
    that fits would wait on the socket for a message never sent."""
    chunk = 64 * 1024
    topology = QueueTopology(local_readers=1, max_chunk_bytes=chunk, max_chunks=2)
    with MessageQueueHarness(topology, broadcast_mode, timeout=5) as harness:
        for lap in range(2):
            for kind, size in (("overflow", 2 * chunk), ("fits", chunk // 4)):
                for slot in range(topology.max_chunks):
                    payload = {"blob": np.random.default_rng([lap, slot, size]).bytes(size)}
                    report = harness.broadcast(payload)[1]
                    assert report == describe(payload), (
                        f"lap {lap}, slot {slot}: a message that {kind} arrived different: "
                        f"{report.get(READ_ERROR, 'other bytes')}")


@pytest.mark.parametrize(("topology", "delay", "lines"), [(QueueTopology(local_readers=1), 0.0, 2),
                                                         (QueueTopology(local_readers=1), 1.5, 2),
                                                         (QueueTopology(local_readers=0, remote_readers=1), 0.0, 0)],
                         ids=["ring", "idle-ring", "remote-tcp"])
def test_a_read_with_nothing_sent_ends_at_its_timeout(topology, delay, lines, broadcast_mode, monkeypatch) -> None:
    """``dequeue(timeout=2.5)`` with no message raises TimeoutError after 2.5 s: every wait has its bound.
    A ring reader logs vLLM's long-wait line once an interval meanwhile (set to 1 s): twice. A remote
    reader waits on its socket and logs nothing (vLLM has no long-wait line there).
    ``idle-ring``: the reader starts its read 1.5 s after its last activity, past its busy loop, so it
    wakes at 1, 2 and 2.5 s: the wake at the deadline, inside the second interval, logs no third line."""
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "1")
    with MessageQueueHarness(topology, broadcast_mode, timeout=2.5, delays={1: delay}) as harness:
        report = harness.collect(within=30)[1]
    assert report.get(READ_ERROR, "").startswith("TimeoutError"), f"the reader reported {report}"
    # vLLM rounds the time left down to whole milliseconds: the wait may end a millisecond early.
    assert 2.4 <= report[WAITED_S] < 10, f"dequeue(timeout=2.5) gave up after {report[WAITED_S]:.2f} s"
    assert report[LONG_WAITS] == lines, (
        f"{report[LONG_WAITS]} long-wait lines in a 2.5 s wait with a 1 s interval (expected {lines})")


def test_a_message_of_256_buffers_arrives_whole(broadcast_mode) -> None:
    """A ring chunk counts a message's buffers in two bytes: 255 out-of-band tensors and the pickle
    stream (each out-of-band buffer at least 1 MiB, so a 256 MiB chunk, as VLLM_MQ_MAX_CHUNK_BYTES_MB
    allows) must arrive whole; a count read from its low byte alone reads none. The tensors are
    views of one MiB, and the ring one chunk: 257 MiB of /dev/shm, and the reader's copies."""
    base = torch.arange(MiB, dtype=torch.int32).to(torch.uint8)
    payload = {f"t{i}": base[:] for i in range(255)}
    topology = QueueTopology(local_readers=1, max_chunk_bytes=257 * MiB, max_chunks=1)
    with MessageQueueHarness(topology, broadcast_mode, timeout=60) as harness:
        reports = harness.broadcast(payload)
    assert reports[1] == describe(payload), (
        f"a message of 256 buffers arrived different: {reports[1].get(READ_ERROR, 'other bytes')}")


_RECV_PAST_ITS_DEADLINE = """
import time, zmq
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
socket = zmq.Context().socket(zmq.SUB)
socket.setsockopt_string(zmq.SUBSCRIBE, "")
socket.bind("tcp://127.0.0.2:*")
started = time.monotonic()
try:
    MessageQueue.recv(socket, {timeout})
except TimeoutError:
    print("TimeoutError after %.3f s" % (time.monotonic() - started))
"""


def test_a_socket_read_whose_time_is_up_raises_at_once() -> None:
    """``MessageQueue.recv`` (a remote reader's dequeue, and a local one's overflow) with no time left,
    as a caller that computes what remains of its deadline passes it, raises TimeoutError at once:
    a negative timeout must not become ZMQ's -1, which waits for ever. Run in a child process (vLLM's
    module, overlay included) with a bound, since the failure is a wait that never ends."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _RECV_PAST_ITS_DEADLINE.format(timeout=-0.5)],
                          capture_output=True, text=True, timeout=30)
    lines = proc.stdout.split()
    assert lines[:1] == ["TimeoutError"], f"rc={proc.returncode}: {proc.stdout}{proc.stderr[-1500:]}"
    assert float(lines[2]) < 1.0, f"recv(timeout=-0.5) raised after {lines[2]} s"


def test_a_read_without_a_deadline_wakes_and_says_so_each_interval(broadcast_mode, monkeypatch) -> None:
    """``dequeue()`` with no timeout waits for as long as nothing comes, yet wakes once an interval
    (1 s here) to log vLLM's long-wait line, as a worker's log shows a stuck writer: over 4.5 s,
    a line at each of 1, 2, 3 and 4 s. A reader that slept until the message came would log at
    most one line per busy-loop exit and one after the message."""
    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "1")
    with MessageQueueHarness(QueueTopology(local_readers=1), broadcast_mode, timeout=20,
                             read_deadline=False) as harness:
        time.sleep(4.5)
        report = harness.waits()[1]
    assert report[WAITED_S] >= 4.4, f"the read returned after {report[WAITED_S]:.2f} s, before the message"
    # A busy machine may wake the reader late: 3 lines at the least; a line per interval at the most.
    assert 3 <= report[LONG_WAITS] <= 5, (
        f"{report[LONG_WAITS]} long-wait lines in a {report[WAITED_S]:.1f} s wait with a 1 s interval")


def test_a_new_ring_owns_its_pages(broadcast_mode, expect) -> None:
    """tmpfs allocates a page at its first write, and a write that a full /dev/shm cannot place
    is SIGBUS (measured: fill-head-shm killed the engine so). A new ring must own every page
    when it is created: the testbed's does (``reserve_ring``); vLLM's is sparse."""
    import os

    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    from vllm_zerocopy_testbed.config import PatchMode
    from vllm_zerocopy_testbed.patches import broadcast

    expect("ring_reserved", broadcast_mode)
    broadcast.apply(broadcast_mode)
    try:
        ring = ShmRingBuffer(n_reader=1, max_chunk_bytes=4 * MiB, max_chunks=MAX_CHUNKS)
        size = ring.total_bytes_of_buffer
        try:
            allocated = os.stat(os.path.join(broadcast.SHM_DIR, ring.shared_memory.name.lstrip("/"))).st_blocks * 512
        finally:
            ring.shared_memory.close()
            ring.shared_memory.unlink()
            del ring  # nothing of it left for a failure's traceback to hold
    finally:
        broadcast.apply(PatchMode.UPSTREAM)
    assert allocated >= size, f"the ring is sparse: {allocated} of its {size} bytes allocated"
