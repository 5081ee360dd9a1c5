"""How the testbed hands out-of-band frames to ZMQ, over a real inproc socket pair.

Over ``inproc`` ZMQ passes a zero-copy message to the peer by reference, so a
buffer changed after the send shows in what the peer receives: the send race of
upstream PR 53217, made deterministic.
"""

from __future__ import annotations

import time

import pytest

from vllm_zerocopy_testbed.patches.broadcast import (OOB_MIN_BYTES, SendNotReleased, _send, _wait_sent,
                                                     release_deadline)

pytestmark = pytest.mark.unit


def _send_then_reuse(sender, receiver, nbytes: int, hold: bool) -> tuple[list, bytes]:
    buffer = bytearray(b"\x01" * nbytes)
    releases = _send(sender, [b"stream", memoryview(buffer)], hold=hold)
    buffer[:] = b"\x02" * nbytes  # the caller reuses its tensor once enqueue returned
    frames = receiver.recv_multipart()
    return releases, frames[1]


def test_a_racy_send_lets_the_peer_see_later_writes(pair) -> None:
    """Upstream's send (``copy=False``, not held): the peer gets the bytes written after it."""
    _, received = _send_then_reuse(*pair, OOB_MIN_BYTES, hold=False)
    assert received == b"\x02" * OOB_MIN_BYTES


def test_out_of_band_frames_are_zero_copy_and_waited_on(pair) -> None:
    """The testbed's send: the frame is the caller's buffer (no copy), released only once ZMQ let it go."""
    sender, receiver = pair
    buffer = bytearray(b"\x01" * OOB_MIN_BYTES)
    releases = _send(sender, [b"stream", memoryview(buffer)], hold=True)
    assert len(releases) == 1
    with pytest.raises(SendNotReleased):  # inproc: released only once the peer dropped the message
        _wait_sent([("the peer", releases)], time.monotonic() + 0.2)
    frames = receiver.recv_multipart(copy=False)
    assert frames[1].bytes == bytes(buffer)
    buffer[0] = 3  # zero copy: over inproc the peer's frame is the caller's memory
    assert frames[1].buffer[0] == 3
    with pytest.raises(SendNotReleased):  # the peer still holds the message
        _wait_sent([("the peer", releases)], time.monotonic() + 0.2)
    del frames
    _wait_sent([("the peer", releases)], time.monotonic() + 10)
    buffer[:] = b"\x02" * OOB_MIN_BYTES  # now safe: nobody reads the old bytes any more


def test_a_held_send_keeps_the_stream_in_one_untracked_frame(pair) -> None:
    """Messages without out-of-band buffers have nothing to wait for."""
    sender, receiver = pair
    assert _send(sender, [b"stream only"], hold=True) == []
    assert receiver.recv_multipart() == [b"stream only"]


def _held(pair) -> tuple[list, list]:
    """A held send the peer has not received: ZMQ keeps the buffer until the peer takes it."""
    sender, _ = pair
    buffer = bytearray(OOB_MIN_BYTES)
    return _send(sender, [b"stream", memoryview(buffer)], hold=True), [buffer]


def test_a_released_buffer_passes_a_deadline_already_past(pair) -> None:
    """``enqueue(timeout=0)`` succeeds when ZMQ has let go of every buffer by then."""
    sender, receiver = pair
    releases = _send(sender, [b"stream", memoryview(bytearray(OOB_MIN_BYTES))], hold=True)
    receiver.recv_multipart()  # copied out: libzmq frees the message, pyzmq's gc thread drops the view
    deadline = time.monotonic() + 10
    while releases[0][0].locked():
        assert time.monotonic() < deadline, "the buffer was never released"
        time.sleep(0.01)
    _wait_sent([("the peer", releases)], release_deadline(0, time.monotonic()))


@pytest.mark.timeout(30)  # the bound under test is 1 s: a wait without it fails here, not after 300 s
def test_a_stuck_reader_ends_the_wait_at_the_step_timeout_with_a_named_error(pair, monkeypatch) -> None:
    """``timeout=None`` (what vLLM's executors pass) waits VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, not forever;
    the error names the readers, and is no ``TimeoutError`` (the message was sent: no retry)."""
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1")
    releases, _keep = _held(pair)
    started = time.monotonic()
    with pytest.raises(SendNotReleased) as caught:
        _wait_sent([("2 remote reader(s) of tcp://0.0.0.0:5555", releases)], release_deadline(None, started))
    waited = time.monotonic() - started
    assert 1.0 <= waited < 5.0, f"waited {waited:.1f} s for a 1 s bound"
    assert "2 remote reader(s) of tcp://0.0.0.0:5555" in str(caught.value) and "do not retry" in str(caught.value)
    assert not isinstance(caught.value, TimeoutError)


def test_the_timeout_counts_from_the_start_of_enqueue() -> None:
    started = time.monotonic() - 3.0  # the ring's wait and the pickling took 3 s already
    assert release_deadline(5.0, started) == pytest.approx(started + 5.0)
