"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest
import zmq

from vllm_zerocopy_testbed.cluster.shm import SHM_DIR


@pytest.fixture
def pair():
    """A connected ``inproc`` PAIR of sockets: ZMQ hands zero-copy messages to the peer by reference,
    so a frame stays held until the peer drops it (the send race made deterministic)."""
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("inproc://testbed-pair")
    sender.connect("inproc://testbed-pair")
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)
    context.term()


@pytest.fixture
def shm_names():
    """A list the test appends the /dev/shm names it makes to: whatever a failed test left is removed."""
    made: list[str] = []
    yield made
    for name in made:
        (SHM_DIR / name).unlink(missing_ok=True)
