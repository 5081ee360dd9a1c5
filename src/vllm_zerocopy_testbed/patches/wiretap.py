"""A read-only tap on the MessageQueue's ZMQ sends: one log line per large message.

The e2e transport checker reads these lines to tell whether a prompt_embeds
tensor crossed to the remote node out of band (its own frame, the tensor's exact
size) or inside the pickle stream (frame 0). It wraps the socket's send; it never
changes what is sent, in any mode.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from vllm_zerocopy_testbed.patches.timeline import on_send

WIRE_PREFIX = "mq-send"
# Control messages are small; only messages at least this big are logged.
MIN_LOGGED_BYTES = 512 * 1024

# MessageQueue socket -> its path ("remote" or "overflow"); other sockets are not tapped.
_tapped: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_installed = False


def _nbytes(frame: Any) -> int:
    if hasattr(frame, "bytes") and hasattr(frame, "buffer"):  # zmq.Frame
        return len(frame)
    return memoryview(frame).nbytes


def wire_line(path: str, sizes: list[int]) -> str:
    """Return the log line for one message: ``mq-send path=remote frames=a,b,c``."""
    return f"{WIRE_PREFIX} path={path} frames={','.join(map(str, sizes))}"


def install(log: logging.Logger, timeline: bool = False) -> None:
    """Tap every MessageQueue writer created from now on in this process (idempotent).

    With ``timeline``, each large out-of-band frame's hand-off and release also go to
    ``patches/timeline.py`` (the send race's timeline, findings/53217-oob-send-race).
    """
    global _installed
    if _installed:
        return
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    original_init: Callable[..., None] = MessageQueue.__init__
    original_send: Callable[..., Any] = zmq.Socket.send_multipart

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        for name in ("local_socket", "remote_socket"):
            socket = getattr(self, name, None)
            if socket is not None:
                _tapped[socket] = "overflow" if name == "local_socket" else "remote"

    def send_multipart(self: Any, msg_parts: Any, *args: Any, **kwargs: Any) -> Any:
        path = _tapped.get(self)
        if path is not None:
            msg_parts = list(msg_parts)
            sizes = [_nbytes(p) for p in msg_parts]
            if sum(sizes) >= MIN_LOGGED_BYTES:
                log.info(wire_line(path, sizes))
            if timeline:  # every message: readers number them the same way
                on_send(self, path, msg_parts)
        return original_send(self, msg_parts, *args, **kwargs)

    MessageQueue.__init__ = init  # type: ignore[method-assign]
    zmq.Socket.send_multipart = send_multipart  # type: ignore[method-assign]
    _installed = True
