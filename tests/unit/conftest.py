"""Fixtures the unit tests share."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import zmq

from vllm_zerocopy_testbed.cluster.shm import SHM_DIR
from vllm_zerocopy_testbed.patches import timeline


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


@dataclass
class TimelineLog(logging.Handler):
    """What the MessageQueue timeline writer logged: each message, and each line as a node writes it."""

    logger: logging.Logger
    messages: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        # observe/log.py's format: what every node process writes
        self.setFormatter(logging.Formatter("INFO %(asctime)s [testbed] %(message)s", "%m-%d %H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.lines.append(self.format(record))

    __hash__ = logging.Handler.__hash__


@pytest.fixture
def timeline_log(monkeypatch):
    """The timeline writer (``patches/timeline.py``) writing to a logger of its own; yields what it wrote."""
    log = logging.getLogger("testbed-timeline-test")
    handler = TimelineLog(log)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    monkeypatch.setattr(timeline, "_log", log)
    yield handler
    log.removeHandler(handler)
