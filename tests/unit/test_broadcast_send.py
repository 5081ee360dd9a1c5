"""How the testbed hands out-of-band frames to ZMQ, over a real inproc socket pair.

Over ``inproc`` ZMQ passes a zero-copy message to the peer by reference, so a
buffer changed after the send shows in what the peer receives: the send race of
upstream PR 53217, made deterministic.
"""

from __future__ import annotations

import pytest
import zmq

from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES, _send, _wait_sent

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("inproc://testbed-send")
    sender.connect("inproc://testbed-send")
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)
    context.term()


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
    with pytest.raises(TimeoutError):  # inproc: released only once the peer dropped the message
        _wait_sent(releases, timeout=0.2)
    frames = receiver.recv_multipart(copy=False)
    assert frames[1].bytes == bytes(buffer)
    buffer[0] = 3  # zero copy: over inproc the peer's frame is the caller's memory
    assert frames[1].buffer[0] == 3
    with pytest.raises(TimeoutError):  # the peer still holds the message
        _wait_sent(releases, timeout=0.2)
    del frames
    _wait_sent(releases, timeout=10)
    buffer[:] = b"\x02" * OOB_MIN_BYTES  # now safe: nobody reads the old bytes any more


def test_a_held_send_keeps_the_stream_in_one_untracked_frame(pair) -> None:
    """Messages without out-of-band buffers have nothing to wait for."""
    sender, receiver = pair
    assert _send(sender, [b"stream only"], hold=True) == []
    assert receiver.recv_multipart() == [b"stream only"]
