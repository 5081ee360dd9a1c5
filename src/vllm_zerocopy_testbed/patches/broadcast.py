"""Tensor broadcast through vLLM's ``MessageQueue``: our reducer and a race-free enqueue.

``MessageQueue.enqueue`` pickles a message with protocol 5; buffers of at least
``OOB_MIN_BYTES`` leave the pickle stream as out-of-band frames. Readers get
them from the shared-memory ring (copied out) or as ZMQ frames (aliased).

Three properties are under test:

* zero copy (upstream PR 48442): CPU tensors travel as out-of-band buffers
  instead of being serialised by ``torch.save`` into the stream;
* no send race (upstream PR 53217, open): a buffer given to ZMQ with
  ``copy=False`` is sent later by ZMQ's I/O thread, so a caller that reuses its
  tensor after ``enqueue`` returned corrupts what remote readers receive.
* one consumer per reader (upstream vLLM report 50398): two threads dequeuing from
  one reader's queue read the same ring slot; ``testbed`` serializes ``dequeue`` per
  queue object (``serialized_dequeue``).

Our ``testbed`` policy keeps the zero copy and closes the race by waiting, before
``enqueue`` returns, until ZMQ released every out-of-band buffer: no extra copy
and no fresh allocation (a fresh ``bytes()`` of 16 MiB costs more than the
transfer, see ../shared/FINDINGS.md); the writer is held for the time ZMQ needs
to hand the bytes to the kernel, which the reader waits for anyway. Only the ZMQ
paths (overflow to local readers, remote readers) wait: the shared-memory ring
copies the bytes inside ``enqueue`` already. The release is seen through a weak
reference (``_send``), not pyzmq's ``MessageTracker``: with the modes
interleaved message by message and the remote reader on its own core,
testbed / upstream at 1 MiB is 0.98-1.03 with the weak reference (``make bench``:
1.03, spread 9%), 1.05-1.09 with trackers; handing ZMQ a copy instead cost 1.19x
(docs/design.md, "Wait, do not copy", "Seeing the release for less").
"""

from __future__ import annotations

import copyreg
import io
import logging
import pickle
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import zmq

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.patches import arena

logger = logging.getLogger(__name__)

# Buffers at least this large leave the pickle stream (upstream uses the same
# limit): below it one copy into the stream is cheaper than an extra frame.
OOB_MIN_BYTES = 1 << 20

# Ring chunk layout shared with upstream ``dequeue``: byte 0 is the overflow
# flag, bytes 1-2 the buffer count, then per buffer a 4-byte big-endian length
# and the bytes.
_RING_HEADER_BYTES = 3
_RING_LENGTH_BYTES = 4
_RING_COUNT_BYTES = 2


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rebuild_tensor(buffer: Any, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    """Return a writable tensor over ``buffer`` (aliased when writable, else copied).

    Pickle hands over the object the reader passed in ``buffers=``: a
    ``bytearray`` copied out of the ring, a ``zmq.Frame`` (writable, owns its
    message), or ``bytes`` when a buffer was kept in-band.
    """
    dtype = getattr(torch, dtype_name)
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)


def reduce_tensor(tensor: torch.Tensor) -> tuple:
    """Return the pickle reduction of ``tensor``: its raw bytes as a ``PickleBuffer`` when eligible.

    Eligible: a plain CPU strided tensor without grad, conjugate or negative
    bit, not quantized, of any size: the pickler's buffer callback keeps
    buffers under ``OOB_MIN_BYTES`` in-band. Small tensors do not fall back to
    torch's reduction because torch 2.13 cannot load back the fp8 tensors it
    pickles (``UntypedStorage has no attribute 'dtype'``). Everything else
    (including subclasses such as ``nn.Parameter``, which the dispatch table
    never routes here) keeps torch's reduction so its type and flags survive.
    """
    if (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_quantized
    ):
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return rebuild_tensor, (
            pickle.PickleBuffer(raw),
            tuple(tensor.shape),
            _dtype_name(tensor.dtype),
        )
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class EnqueuePolicy:
    """What an ``enqueue`` does with tensors and with frames handed to ZMQ."""

    mode: PatchMode
    zero_copy_tensors: bool  # route CPU tensors through ``reduce_tensor``
    hold_until_sent: bool  # return only after ZMQ released every out-of-band frame


OFF_POLICY = EnqueuePolicy(PatchMode.OFF, zero_copy_tensors=False, hold_until_sent=False)
TESTBED_POLICY = EnqueuePolicy(PatchMode.TESTBED, zero_copy_tensors=True, hold_until_sent=True)


def serialize(obj: Any, zero_copy_tensors: bool, tensor_arena: Any = None) -> list[Any]:
    """Return ``[pickle stream, out-of-band buffer, ...]`` for ``obj``; with a ``tensor_arena``
    (vLLM 0.32's opt-in arena), its pickler as ``TESTBED_ARENA`` chose it copies tensors >= 8 MiB
    into slots first (``patches/arena.py``)."""
    frames: list[Any] = [b""]

    def keep_in_band(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OOB_MIN_BYTES:
            return True
        frames.append(raw)
        return False

    with io.BytesIO() as stream:
        if tensor_arena is not None:
            pickler = arena.pickler_class()(stream, tensor_arena, buffer_callback=keep_in_band)
        else:
            pickler = pickle.Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=keep_in_band)
        if zero_copy_tensors:
            # Start from copyreg's table so globally registered reducers still apply.
            table = dict(copyreg.dispatch_table)
            table[torch.Tensor] = reduce_tensor
            pickler.dispatch_table = table
        pickler.dump(obj)
        frames[0] = stream.getvalue()
    return frames


def _ring_bytes(frames: list[Any]) -> int:
    return _RING_HEADER_BYTES + sum(_RING_LENGTH_BYTES + memoryview(f).nbytes for f in frames)


def _write_ring(chunk: memoryview, frames: list[Any]) -> None:
    chunk[0] = 0  # not overflow
    chunk[1:_RING_HEADER_BYTES] = len(frames).to_bytes(_RING_COUNT_BYTES, "big")
    offset = _RING_HEADER_BYTES
    for frame in frames:
        size = memoryview(frame).nbytes
        chunk[offset : offset + _RING_LENGTH_BYTES] = size.to_bytes(_RING_LENGTH_BYTES, "big")
        offset += _RING_LENGTH_BYTES
        chunk[offset : offset + size] = frame
        offset += size


# One zero-copy buffer handed to ZMQ: a lock released when ZMQ let go of it, and the weak
# reference whose callback releases it (kept alive until the lock is taken).
Release = tuple[threading.Lock, "weakref.ref[memoryview]"]


def _send(socket: zmq.Socket, frames: list[Any], hold: bool) -> list[Release]:
    """Send ``frames``; if ``hold``, return one release per out-of-band frame (sent without a
    copy), which the caller must wait on before the buffers behind them may change.

    pyzmq keeps a zero-copy buffer alive by holding a reference to it until libzmq frees the
    message (its garbage-collector thread drops the reference then). Each buffer is sent as a
    fresh ``memoryview`` that only pyzmq references once this function returns, so a weak
    reference to it dies exactly when ZMQ no longer reads the bytes, and its callback
    releases a plain lock. That is what pyzmq's ``MessageTracker`` says too, without its
    ``threading.Event`` and tracker per frame (~10 us before the send) and the ``Condition``
    its release goes through.
    """
    if not hold or len(frames) == 1:
        socket.send_multipart(frames, copy=False)
        return []
    releases: list[Release] = []
    parts: list[Any] = [frames[0]]
    for buffer in frames[1:]:
        view = memoryview(buffer)
        lock = threading.Lock()
        lock.acquire()
        releases.append((lock, weakref.ref(view, lambda _, lock=lock: lock.release())))
        parts.append(view)
    socket.send_multipart(parts, copy=False)
    return releases


class SendNotReleased(RuntimeError):
    """ZMQ still held a message's out-of-band buffers at the bound: a reader is not consuming.

    Not a ``TimeoutError``: ``acquire_write`` raises that when nothing was written and a
    retry is safe; here the message is already in ZMQ's hands, and a retry would send it twice.
    """


# One message's zero-copy buffers on one path, and who reads that path (for the error).
Pending = tuple[str, list[Release]]


def release_deadline(timeout: float | None, started: float) -> float:
    """Return when the wait for ZMQ's release must end.

    ``timeout`` counts from the start of ``enqueue`` (the ring's wait included), so the
    whole call stays within it. vLLM's executors pass ``timeout=None`` and bound the step
    instead: the RPC fails after ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` when a worker does
    not answer. The same bound here keeps the fix no less available than upstream's
    racy send, which returns at once and leaves the RPC to time out.
    """
    if timeout is not None:
        return started + timeout
    from vllm import envs

    return time.monotonic() + float(envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)


def _left(timeout: float | None, started: float) -> float | None:
    """What is left of ``timeout`` (seconds) since ``started``; ``None`` stays unbounded."""
    return None if timeout is None else max(0.0, started + timeout - time.monotonic())


def _wait_sent(pending: list[Pending], deadline: float) -> None:
    """Block until ZMQ no longer reads any of the buffers, until ``deadline`` (monotonic) at most.

    A buffer already released passes even with the deadline past (``timeout=0``).
    """
    from vllm import envs

    warn_every = float(envs.VLLM_RINGBUFFER_WARNING_INTERVAL)
    started = time.monotonic()
    for index, (_, releases) in enumerate(pending):
        for lock, _ in releases:
            while not lock.acquire(timeout=max(0.0, min(warn_every, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise SendNotReleased(
                        "MessageQueue.enqueue: ZMQ still holds this message's out-of-band buffers "
                        f"{time.monotonic() - started:.1f} s after the send; not consuming: "
                        f"{', '.join(_holders(pending[index:]))}. The message was sent: do not retry; "
                        "a stopped or stuck reader holds it (bound: the enqueue timeout, else "
                        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)"
                    )
                logger.warning(
                    "MessageQueue.enqueue: out-of-band buffers not released after %.0f s (%s); "
                    "is every reader alive?", time.monotonic() - started, ", ".join(_holders(pending[index:])))


def _holders(pending: list[Pending]) -> list[str]:
    """The readers of each path whose buffers are not all released yet."""
    held = []
    for readers, releases in pending:
        free = [lock.acquire(blocking=False) for lock, _ in releases]
        for got, (lock, _) in zip(free, releases):
            if got:
                lock.release()  # the check must not consume a release the wait still needs
        if not all(free):
            held.append(readers)
    return held


def _readers(mq: Any, path: str) -> str:
    """Name who reads ``path`` of ``mq``: count and endpoint (ZMQ does not say which subscriber holds)."""
    if path == "remote":
        endpoint = mq.remote_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        return f"{mq.n_remote_reader} remote reader(s) of {endpoint}"
    return f"{mq.n_local_reader} local reader(s) of the overflow socket"


def make_enqueue(policy: EnqueuePolicy) -> Callable[..., None]:
    """Return a ``MessageQueue.enqueue`` replacement that follows ``policy``."""

    def enqueue(self: Any, obj: Any, timeout: float | None = None) -> None:
        assert self._is_writer, "Only writers can enqueue"
        started = time.monotonic()
        # The arena (if any) takes tensors >= 8 MiB; what it leaves (smaller tensors, arrays, a
        # full arena's fallbacks) may overflow to ZMQ and is held like any other message's.
        frames = serialize(obj, policy.zero_copy_tensors, getattr(self, "tensor_arena", None))
        pending: list[Pending] = []
        if self.n_local_reader > 0:
            if _ring_bytes(frames) > self.buffer.max_chunk_bytes:
                with self.acquire_write(_left(timeout, started)) as chunk:
                    chunk[0] = 1  # overflow: readers take the frames from the socket
                pending.append((_readers(self, "overflow"),
                                _send(self.local_socket, frames, policy.hold_until_sent)))
            else:
                with self.acquire_write(_left(timeout, started)) as chunk:
                    _write_ring(chunk, frames)
            spin = getattr(self, "_spin_condition", None)
            if spin is not None:
                spin.notify()
        if self.n_remote_reader > 0:
            pending.append((_readers(self, "remote"), _send(self.remote_socket, frames, policy.hold_until_sent)))
        if any(releases for _, releases in pending):
            _wait_sent(pending, release_deadline(timeout, started))

    enqueue.testbed_mode = policy.mode  # type: ignore[attr-defined]
    return enqueue


_installed_enqueue: Callable[..., None] | None = None
_installed_ring_init: Callable[..., None] | None = None
_installed_dequeue: Callable[..., Any] | None = None
_DEQUEUE_LOCK = "_testbed_dequeue_lock"


def serialized_dequeue(installed: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``MessageQueue.dequeue`` that lets one thread at a time read from a queue object.

    A reader's ring cursor (``current_idx``) and its ZMQ sockets belong to the object, and
    ``acquire_read`` binds the cursor's slot once before it waits: two threads of one reader both
    read a slot, or one waits on a slot the other already read (upstream vLLM report 50398; its fix,
    upstream PR 50423, the same per-object lock, was closed unmerged). Without contention the
    cost is one uncontended lock; ``timeout`` bounds the wait for the lock and the read together.
    """

    def dequeue(self: Any, timeout: float | None = None, indefinite: bool = False) -> Any:
        lock = self.__dict__.get(_DEQUEUE_LOCK) or self.__dict__.setdefault(_DEQUEUE_LOCK, threading.Lock())
        started = time.monotonic()
        if not lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError
        try:
            return installed(self, timeout=_left(timeout, started), indefinite=indefinite)
        finally:
            lock.release()

    dequeue.testbed_mode = PatchMode.TESTBED  # type: ignore[attr-defined]
    return dequeue


SHM_DIR = "/dev/shm"


class RingSpaceError(RuntimeError):
    """/dev/shm cannot hold a MessageQueue ring's pages: raised when the ring is created."""


def reserve_ring(shared_memory: Any) -> None:
    """Allocate every page of a new ring's shared memory now (``posix_fallocate``).

    ``SharedMemory(create=True)`` only sizes the file: tmpfs allocates a page at its first
    write, and a write to a page that a full /dev/shm cannot allocate is SIGBUS. Measured
    (``make faults``, fill-head-shm): the head's /dev/shm filled after start-up, the engine
    died with "Fatal Python error: Bus error" writing its ring; vLLM checks the free space
    when it creates the ring (``check_shm_free_space``), which a later fill does not see.
    Reserved, a full /dev/shm fails the start with this error, never a running engine.
    """
    import errno
    import os

    path = os.path.join(SHM_DIR, shared_memory.name.lstrip("/"))
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, shared_memory.size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        free = os.statvfs(SHM_DIR)
        raise RingSpaceError(
            f"{SHM_DIR} cannot hold a MessageQueue ring of {shared_memory.size / 2**20:.0f} MiB "
            f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): its pages are reserved when it is created, "
            "so that a /dev/shm filled later cannot SIGBUS the engine. Increase /dev/shm (--shm-size)") from exc
    finally:
        os.close(fd)


def _ring_init(installed: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        installed(self, *args, **kwargs)
        if getattr(self, "is_creator", False):
            try:
                reserve_ring(self.shared_memory)
            except BaseException:
                self.shared_memory.close()
                self.shared_memory.unlink()
                raise

    __init__.testbed_mode = PatchMode.TESTBED  # type: ignore[attr-defined]
    return __init__


def apply(mode: PatchMode) -> None:
    """Make ``MessageQueue.enqueue`` behave as ``mode`` in this process; under ``testbed``, new
    rings also reserve their pages (``reserve_ring``) and ``dequeue`` takes one thread at a time
    (``serialized_dequeue``). Apply the arena's mode first (``arena.guard``)."""
    global _installed_enqueue, _installed_ring_init, _installed_dequeue
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, ShmRingBuffer

    if _installed_enqueue is None:
        _installed_enqueue = MessageQueue.enqueue
    if _installed_ring_init is None:
        _installed_ring_init = ShmRingBuffer.__init__
    if _installed_dequeue is None:
        _installed_dequeue = MessageQueue.dequeue
    MessageQueue.dequeue = (serialized_dequeue(_installed_dequeue) if mode is PatchMode.TESTBED  # type: ignore[method-assign]
                            else _installed_dequeue)
    ShmRingBuffer.__init__ = (_ring_init(_installed_ring_init) if mode is PatchMode.TESTBED  # type: ignore[method-assign]
                              else _installed_ring_init)
    if mode is PatchMode.UPSTREAM:
        enqueue = _installed_enqueue
    else:
        enqueue = make_enqueue(TESTBED_POLICY if mode is PatchMode.TESTBED else OFF_POLICY)
    # The arena's mode (applied before) may guard any enqueue against slots a failed one leaks.
    MessageQueue.enqueue = arena.guard(enqueue)  # type: ignore[method-assign]


def active_mode() -> PatchMode:
    """Return the mode ``MessageQueue.enqueue`` currently follows in this process."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    return getattr(MessageQueue.enqueue, "testbed_mode", PatchMode.UPSTREAM)
