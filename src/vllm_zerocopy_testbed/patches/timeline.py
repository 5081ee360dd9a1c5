"""A timeline of every out-of-band MessageQueue buffer (``TESTBED_MQ_TIMELINE=1``; off by default).

The send race (findings/53217-oob-send-race): upstream PR 53217 says remote workers receive
buffers that the engine wrote again while ZMQ still held them. Whether that happens is a
question of three times, all taken on the engine's monotonic clock:

* ``send``: an out-of-band frame (>= 1 MiB) is handed to ZMQ with ``copy=False``; logged
  with its address, size, CRC-32 and the RPC it belongs to (``execute_model``, ...);
* ``release``: ZMQ let go of it: a finalizer on the very object handed to ZMQ runs when
  pyzmq drops its reference (the caller's references are gone once ``enqueue`` returned),
  the same signal ``patches/broadcast.py`` waits on;
* ``write``: the engine starts writing into that memory again: the structured-output
  manager filling its persistent grammar bitmask (hooked here), or a later send handing
  over the same memory with another CRC (then it was written at the latest by that send).
* ``schedule``: the scheduler formed a batch (tokens, requests), so that a write can be
  told apart as the next batch of a pipeline or the next step of the same requests.

Readers log the CRC-32 of every out-of-band frame they receive (``recv``), keyed like the
writer's by the socket's port and the message's sequence number on that socket, so bytes
that changed on the way show as a CRC that differs from the writer's at hand-off.
``checker/timeline.py`` turns the lines into figures. What is sent does not change;
the cost is one CRC per large frame on each side (about 1.3 ms per 3 MiB here).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import threading
import time
import weakref
import zlib
from typing import Any, Callable

import numpy as np

TIMELINE_PREFIX = "mq-timeline"
# Out-of-band frames start at upstream's limit.
MIN_FRAME_BYTES = 1 << 20

_log: logging.Logger | None = None
_current = threading.local()  # .kind: the message this thread is enqueueing
_sent: dict[int, int] = {}  # id(socket) -> messages sent on it
_received: dict[int, int] = {}  # id(socket) -> messages received on it
_installed: set[str] = set()


def _emit(event: dict[str, Any]) -> None:
    if _log is not None:
        _log.info("%s %s", TIMELINE_PREFIX, json.dumps(event, separators=(",", ":")))


def _released(event: dict[str, Any]) -> None:
    _emit({**event, "t": time.monotonic()})


def _address(buffer: Any) -> tuple[int, int]:
    """Return ``(address of the first byte, size)`` of a buffer, read-only ones included."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


def _port(socket: Any) -> int:
    """The TCP/IPC endpoint's port: the same number on the writer's and the readers' sockets."""
    import zmq

    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def message_kind(obj: Any) -> str:
    """Return what a MessageQueue message is: the RPC's method name, else the object's type."""
    if isinstance(obj, tuple) and obj and isinstance(obj[0], str):
        return obj[0]
    return type(obj).__name__


def _next(counter: dict[int, int], socket: Any) -> int:
    seq = counter.get(id(socket), 0)
    counter[id(socket)] = seq + 1
    return seq


def _large(frames: list[Any]):
    """Yield ``(index, frame, address, size)`` for each out-of-band frame >= MIN_FRAME_BYTES."""
    for index, frame in enumerate(frames[1:], start=1):
        try:
            address, nbytes = _address(frame)
        except (TypeError, ValueError):
            continue
        if nbytes >= MIN_FRAME_BYTES:
            yield index, frame, address, nbytes


def on_send(socket: Any, path: str, frames: list[Any]) -> None:
    """Log one message's large frames as handed to ZMQ, and arrange to log their release."""
    seq = _next(_sent, socket)  # every message counts: readers number them the same way
    kind = getattr(_current, "kind", "?")
    port: int | None = None  # read from the socket only for a message with a large frame
    for index, frame, address, nbytes in _large(frames):
        port = _port(socket) if port is None else port
        key = {"pid": os.getpid(), "port": port, "seq": seq, "frame": index}
        _emit({"ev": "send", **key, "path": path, "kind": kind, "addr": address, "nbytes": nbytes,
               "crc": zlib.crc32(frame), "t": time.monotonic()})
        try:
            weakref.finalize(frame, _released, {"ev": "release", **key}).atexit = False
        except TypeError:  # not weak-referenceable (bytes): immutable, so nothing to race
            pass


def on_recv(socket: Any, frames: list[Any]) -> None:
    """Log the CRC-32 of each large out-of-band frame a reader received."""
    seq = _next(_received, socket)
    port: int | None = None
    for index, frame, _, nbytes in _large(frames):
        port = _port(socket) if port is None else port
        _emit({"ev": "recv", "pid": os.getpid(), "port": port, "seq": seq, "frame": index, "nbytes": nbytes,
               "crc": zlib.crc32(frame)})


def on_write(kind: str, buffer: Any, started: float, rows: int | None = None) -> None:
    """Log that the engine started writing ``buffer`` (a persistent one) at ``started``
    (``rows``: how many of its rows this fill wrote, where that is known)."""
    address, nbytes = _address(buffer)
    _emit({"ev": "write", "pid": os.getpid(), "kind": kind, "addr": address, "nbytes": nbytes, "rows": rows,
           "t": started})


def on_schedule(output: Any) -> None:
    """Log one batch the scheduler formed: its tokens and requests (an empty one included)."""
    _emit({"ev": "schedule", "pid": os.getpid(), "tokens": output.total_num_scheduled_tokens,
           "reqs": len(output.num_scheduled_tokens), "t": time.monotonic()})


def _label_enqueue(installed: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``MessageQueue.enqueue`` (whatever mode installed it) to name each message's RPC."""

    @functools.wraps(installed)  # keeps ``testbed_mode``: the mode line still reads true
    def enqueue(self: Any, obj: Any, timeout: float | None = None) -> None:
        _current.kind = message_kind(obj)
        try:
            return installed(self, obj, timeout)
        finally:
            _current.kind = "?"

    return enqueue


def _recv(socket: Any, timeout: float | None) -> Any:
    """``MessageQueue.recv`` with the frames logged before they are unpickled."""
    timeout_ms = None if timeout is None else max(0, int(timeout * 1000))
    if not socket.poll(timeout=timeout_ms):
        raise TimeoutError
    frames = socket.recv_multipart(copy=False)
    on_recv(socket, frames)
    return pickle.loads(frames[0], buffers=frames[1:])


def install_writer(log: logging.Logger) -> None:
    """In the engine: label messages by RPC and log when the grammar bitmask is refilled."""
    global _log
    _log = log
    if "writer" in _installed:
        return
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    MessageQueue.enqueue = _label_enqueue(MessageQueue.enqueue)  # type: ignore[method-assign]
    fill: Callable[..., Any] = StructuredOutputManager.grammar_bitmask

    @functools.wraps(fill)
    def grammar_bitmask(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = fill(self, *args, **kwargs)
        persistent = getattr(self, "_grammar_bitmask", None)
        if result is not None and persistent is not None:
            on_write("grammar_bitmask", persistent.numpy(), started, rows=len(result))
        return result

    StructuredOutputManager.grammar_bitmask = grammar_bitmask  # type: ignore[method-assign]
    schedule: Callable[..., Any] = Scheduler.schedule

    @functools.wraps(schedule)
    def traced_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        on_schedule(output)
        return output

    Scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    _installed.add("writer")


def install_reader(log: logging.Logger) -> None:
    """In a worker: log what every MessageQueue socket read delivered."""
    global _log
    _log = log
    if "reader" in _installed:
        return
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    MessageQueue.recv = staticmethod(_recv)  # type: ignore[method-assign]
    _installed.add("reader")
