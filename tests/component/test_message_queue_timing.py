"""vLLM's MessageQueue when nothing happens in lock-step: a writer ahead of slow readers, readers
at different speeds, a reader idle past its busy loop, and each size threshold from both sides.

In a served engine the scheduler enqueues the next step while a worker is still busy with the
last one; the other component tests collect every reader's report before the next ``send``.
Here the writer sends a whole run of messages first and the readers report afterwards, in
order, so a message overwritten, skipped or read twice shows as a wrong digest at its index.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vllm_zerocopy_testbed.harness.message_queue import (READ_ERROR, RECEIVED_AT, MessageQueueHarness,
                                                         QueueTopology, describe)
from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES

pytestmark = [pytest.mark.component, pytest.mark.timeout(240)]

MiB = 1 << 20
MAX_CHUNKS = 10  # MessageQueue's ring slots
# Reader 1 keeps up, reader 2 is slow, reader 3 in between (seconds before each read).
SPEEDS = {1: 0.0, 2: 0.03, 3: 0.005}

AHEAD = {
    "ring-3-local": QueueTopology(local_readers=3, max_chunk_bytes=4 * MiB),
    "overflow-2-local": QueueTopology(local_readers=2, max_chunk_bytes=MiB),
    "local+remote": QueueTopology(local_readers=2, remote_readers=1, max_chunk_bytes=4 * MiB),
}


def _message(index: int) -> dict:
    """A step's worth: a small in-band tensor and a 1.5 MiB array out of band, both unique to ``index``."""
    gen = torch.Generator().manual_seed(index)
    return {"ids": torch.randint(0, 1 << 30, (64 + index,), generator=gen),
            "array": np.random.default_rng(index).standard_normal(3 * MiB // 16 + index).astype(np.float32)}


def _assert_in_order(harness: MessageQueueHarness, sent: list[dict]) -> None:
    """Collect one report per message and reader: each must be that message, in the order sent."""
    for index, payload in enumerate(sent):
        expected = describe(payload)
        for rank, report in harness.collect().items():
            assert READ_ERROR not in report, f"reader {rank}, message {index}: {report[READ_ERROR]}"
            assert report == expected, (f"reader {rank} read message {index} wrong: a slot overwritten before "
                                        f"it read it, skipped or read twice")


@pytest.mark.parametrize("topology", AHEAD.values(), ids=AHEAD.keys())
def test_a_writer_ahead_of_readers_at_different_speeds_loses_nothing(topology, broadcast_mode) -> None:
    """Three laps of the ring sent back to back to one fast, one slow and one middling reader,
    each keeping every message: the writer must wait for the slowest before it reuses a slot, and
    what the readers kept must not change while it does."""
    sent = [_message(i) for i in range(3 * MAX_CHUNKS)]
    delays = {rank: SPEEDS[rank] for rank in range(1, topology.readers + 1)}
    with MessageQueueHarness(topology, broadcast_mode, timeout=60, delays=delays, keep=True) as harness:
        for payload in sent:
            harness.send(payload)
        _assert_in_order(harness, sent)
        kept = harness.recheck()
    expected = {f"{i}/{name}": item.digest for i, p in enumerate(sent) for name, item in describe(p).items()}
    for rank, report in kept.items():
        changed = sorted(key for key, item in report.items() if item.digest != expected[key])
        assert not changed, f"reader {rank}: messages it kept changed while the writer went on: {changed[:6]}"


def test_a_writer_ahead_of_every_reader_stops_at_a_full_ring(broadcast_mode) -> None:
    """Both readers stopped: the writer may fill the ring's 10 slots and no more, then goes on once
    they read, and they get every message in order."""
    sent = [_message(i) for i in range(2 * MAX_CHUNKS + 3)]
    topology = QueueTopology(local_readers=2, max_chunk_bytes=4 * MiB)
    with MessageQueueHarness(topology, broadcast_mode, timeout=60) as harness:
        written: list[int] = []
        failed: list[BaseException] = []

        def write_all() -> None:
            try:
                for index, payload in enumerate(sent):
                    harness.send(payload)
                    written.append(index)
            except BaseException as exc:  # the test reports it below
                failed.append(exc)

        harness.pause_readers()
        writer = threading.Thread(target=write_all, name="testbed-writer-ahead", daemon=True)
        try:
            writer.start()
            writer.join(timeout=2.0)  # time enough to overrun the ring, were it allowed to
            in_ring = len(written)
        finally:
            harness.resume_readers()
        writer.join(timeout=60)
        assert not failed, f"enqueue failed once the readers went on: {failed[0]!r}"
        assert in_ring == MAX_CHUNKS, (f"with every reader stopped the writer enqueued {in_ring} messages into "
                                       f"a ring of {MAX_CHUNKS} slots")
        _assert_in_order(harness, sent)


def test_an_idle_reader_sleeps_once_its_busy_loop_is_over(broadcast_mode, monkeypatch) -> None:
    """A reader spins for 1 s after its last read, then sleeps on the writer's notification: idle
    from then on, it uses no CPU (a worker waiting for the next step must not hold a core), and the
    next message still reaches it. Measured after a message that woke it from that sleep: a reader
    that leaves the notification unread finds its socket ready from then on, and spins. (The
    long-wait interval at 1 s wakes it every second, as a default reader wakes every 5 s: a reader
    that spins when it should sleep shows within 3 s.)"""
    import psutil

    monkeypatch.setenv("VLLM_RINGBUFFER_WARNING_INTERVAL", "1")
    with MessageQueueHarness(QueueTopology(local_readers=1), broadcast_mode, timeout=30, ack_only=True) as harness:
        harness.broadcast({"warm": torch.zeros(4)})
        time.sleep(1.5)  # past the busy loop: the reader sleeps on the notification
        harness.broadcast({"woken": torch.zeros(4)})  # a reader woken must take its notification
        reader = psutil.Process(harness.reader_pids[0])
        time.sleep(1.5)  # past the busy loop again
        before = sum(reader.cpu_times()[:2])
        time.sleep(3.0)
        used = sum(reader.cpu_times()[:2]) - before
        assert RECEIVED_AT in harness.broadcast({"next": torch.zeros(4)})[1], "the idle reader missed a message"
    assert used < 0.5, f"an idle reader used {used:.2f} s of CPU in 3 s past its busy loop"


def test_a_writer_at_a_full_ring_gives_up_at_its_timeout_and_says_so_each_interval(broadcast_mode, monkeypatch,
                                                                                  log_lines) -> None:
    """Readers stopped, ring full: ``enqueue(timeout=2.5)`` raises TimeoutError after 2.5 s, having
    logged vLLM's long-wait line once a second (the interval set to 1 s): twice. Nothing was written,
    so the readers get the ten messages in the ring and no more once they go on."""
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "VLLM_RINGBUFFER_WARNING_INTERVAL", 1)
    logged = log_lines(shm_broadcast.logger)
    sent = [_message(i) for i in range(MAX_CHUNKS)]
    outcome: list[BaseException | None] = []
    with MessageQueueHarness(QueueTopology(local_readers=1, max_chunk_bytes=4 * MiB), broadcast_mode,
                             timeout=60) as harness:
        harness.pause_readers()
        try:
            for payload in sent:
                harness.send(payload)

            def one_more() -> None:
                try:
                    harness.writer.enqueue(_message(MAX_CHUNKS), timeout=2.5)
                    outcome.append(None)
                except BaseException as exc:  # the test reports it below
                    outcome.append(exc)

            started = time.monotonic()
            writer = threading.Thread(target=one_more, name="testbed-writer-full-ring", daemon=True)
            writer.start()
            writer.join(timeout=20)
            waited = time.monotonic() - started
        finally:
            harness.resume_readers()
        writer.join(timeout=20)  # a writer that never gave up writes once the readers go on
        assert outcome and isinstance(outcome[0], TimeoutError), (
            f"enqueue(timeout=2.5) at a full ring: {outcome[0]!r} after {waited:.1f} s" if outcome else
            f"enqueue(timeout=2.5) at a full ring still waited after {waited:.1f} s")
        assert 2.4 <= waited < 10, f"enqueue(timeout=2.5) gave up after {waited:.2f} s"
        _assert_in_order(harness, sent)
    waits = sum(line.startswith(shm_broadcast.LONG_WAIT_TIME_LOG_MSG.split("%")[0]) for line in logged)
    assert waits == 2, f"{waits} long-wait lines in a 2.5 s wait with a 1 s interval (expected 2)"


def test_a_reader_idle_past_its_busy_loop_wakes_at_the_next_message(broadcast_mode) -> None:
    """A reader that read nothing for longer than its busy loop (1 s) sleeps on the writer's
    notification; without it, it would look again only at its 5 s recheck. Three idle gaps."""
    topology = QueueTopology(local_readers=1)
    with MessageQueueHarness(topology, broadcast_mode, timeout=30, ack_only=True) as harness:
        harness.broadcast({"warm": torch.zeros(4)})
        late = []
        for _ in range(3):
            time.sleep(1.5)
            sent_at = time.perf_counter()
            harness.send({"step": torch.zeros(4)})
            late.append(harness.collect()[1][RECEIVED_AT] - sent_at)
    assert max(late) < 2.5, f"an idle reader got the next message {max(late):.2f} s after it was sent: {late}"


class _CountingSocket:
    """A writer socket that counts ``send_multipart`` calls and forwards everything."""

    def __init__(self, socket) -> None:
        self._socket = socket
        self.sends = 0
        self.frames: list[list[int]] = []  # per send, the byte size of each frame

    def send_multipart(self, msg_parts, *args, **kwargs):
        self.sends += 1
        self.frames.append([memoryview(part).nbytes for part in msg_parts])
        return self._socket.send_multipart(msg_parts, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._socket, name)


def _in_band_message(stream_size: int) -> dict:
    """A message whose pickle stream is ``stream_size`` bytes, every byte in band."""
    import pickle

    overhead = len(pickle.dumps({"blob": bytes(stream_size)}, protocol=pickle.HIGHEST_PROTOCOL)) - stream_size
    return {"blob": np.random.default_rng(stream_size).bytes(stream_size - overhead)}


def test_the_ring_holds_a_message_up_to_its_chunk_and_overflows_one_byte_past_it(broadcast_mode) -> None:
    """A chunk holds 3 header bytes, 4 length bytes and the stream: a stream of chunk - 7 bytes
    stays in the ring (no socket send), chunk - 6 goes to the overflow socket."""
    chunk = MiB
    topology = QueueTopology(local_readers=1, max_chunk_bytes=chunk)
    with MessageQueueHarness(topology, broadcast_mode, timeout=20) as harness:
        counter = _CountingSocket(harness.writer.local_socket)
        harness.writer.local_socket = counter
        try:
            sends = {}
            for size in (chunk - 8, chunk - 7, chunk - 6, chunk - 5):
                before = counter.sends
                payload = _in_band_message(size)
                assert harness.broadcast(payload)[1] == describe(payload), f"a {size}-byte stream arrived different"
                sends[size] = counter.sends - before
        finally:
            harness.writer.local_socket = counter._socket
    assert sends == {chunk - 8: 0, chunk - 7: 0, chunk - 6: 1, chunk - 5: 1}, (
        f"overflow sends per stream size (chunk {chunk}): {sends}")


def test_a_message_with_an_out_of_band_buffer_fills_its_chunk_exactly_and_overflows_one_byte_past_it(
        broadcast_mode) -> None:
    """Each out-of-band buffer takes 4 length bytes and its own in the chunk besides the stream's:
    a 1 MiB array with a stream that fills the 2 MiB chunk to the byte stays in the ring, one byte
    more goes to the overflow socket (the stream's size is read off a first message that overflows)."""
    chunk = 2 * MiB
    array = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)  # exactly the out-of-band limit
    topology = QueueTopology(local_readers=1, max_chunk_bytes=chunk)
    with MessageQueueHarness(topology, broadcast_mode, timeout=20) as harness:
        counter = _CountingSocket(harness.writer.local_socket)
        harness.writer.local_socket = counter
        try:
            probe = {"array": array, "blob": bytes(chunk)}
            harness.broadcast(probe)
            assert counter.frames and counter.frames[-1][1:] == [MiB], (
                f"the probe did not overflow with the array out of band: frames {counter.frames}")
            overhead = counter.frames[-1][0] - chunk  # the stream beyond the blob's bytes
            sends = {}
            for past in (-1, 0, 1, 2):  # bytes the message needs beyond the chunk
                stream = chunk + past - (3 + 4 + 4 + MiB)  # flag, count, two lengths, the array
                payload = {"array": array, "blob": np.random.default_rng(past + 2).bytes(stream - overhead)}
                before = counter.sends
                assert harness.broadcast(payload)[1] == describe(payload), f"{past:+d} bytes: arrived different"
                sends[past] = counter.sends - before
        finally:
            harness.writer.local_socket = counter._socket
    assert sends == {-1: 0, 0: 0, 1: 1, 2: 1}, f"overflow sends per bytes past a {chunk}-byte chunk: {sends}"


def test_a_tensor_leaves_the_stream_at_exactly_one_mib(broadcast_mode, expect) -> None:
    """One byte under the out-of-band limit stays in the pickle stream (one frame); at the limit
    the tensor is a frame of its own: the remote reader counts the frames on the wire."""
    expect("zero_copy", broadcast_mode)
    below = torch.randint(0, 256, (OOB_MIN_BYTES - 1,), dtype=torch.uint8)
    at = torch.randint(0, 256, (OOB_MIN_BYTES,), dtype=torch.uint8)
    with MessageQueueHarness(QueueTopology(local_readers=0, remote_readers=1), broadcast_mode,
                             wire_report=True) as harness:
        below_frames = harness.broadcast({"x": below})[1]["frames"]
        at_frames = harness.broadcast({"x": at})[1]["frames"]
    assert len(below_frames) == 1 and below_frames[0] > below.numel(), (
        f"a tensor one byte under the limit left the stream: frames {below_frames}")
    assert at.numel() in at_frames, f"no frame carries the tensor's bytes at the limit: {at_frames}"
    assert at_frames[0] < OOB_MIN_BYTES, f"the pickle stream still holds the tensor at the limit: {at_frames}"
