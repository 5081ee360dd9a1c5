"""A real vLLM ``MessageQueue`` with reader processes, for component tests and benchmarks.

The writer lives in the calling process (where the broadcast mode is applied);
readers are separate processes (forked from a server that imported vLLM once) that
attach through the queue's handle: local readers through the shared-memory ring,
remote readers over TCP on a loopback address. Readers describe every tensor or
array they receive (digest, dtype, shape, writability) and send that back, so
bit-exactness is checked on bytes.
Benchmarks ask only for the time each reader had the message rebuilt
(``ack_only``), and may give remote readers CPUs of their own, as another host's.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.patches import arena, broadcast

logger = logging.getLogger(__name__)

_STOP = "__testbed_stop__"
# Readers that ``keep`` their messages answer this with a fresh report of everything they kept.
_RECHECK = "__testbed_recheck__"
# Every reader answers this with how long its read of it waited (``WAITED_S``) and how many
# long-wait lines it has logged so far (``LONG_WAITS``).
_WAITS = "__testbed_waits__"
# ``(_CONTROL, action, rank or None for all, index)``: a ``keep`` reader acts on its kept message
# ``index`` (``READER_ACTIONS``); every reader acknowledges.
_CONTROL = "__testbed_control__"
# Key of an ``ack_only`` report: ``time.perf_counter()`` in the reader once the message was
# rebuilt; CLOCK_MONOTONIC, so comparable with the writer's on the same host.
RECEIVED_AT = "received_at"
# A reader that could not read a message reports why under this key, then exits; with it, how long
# its last read waited (``WAITED_S``) and how many of vLLM's long-wait lines it logged (``LONG_WAITS``).
READ_ERROR = "read_error"
WAITED_S = "waited_s"
LONG_WAITS = "long_waits"


@dataclass(frozen=True)
class QueueTopology:
    """Who reads from the queue, and how large a ring chunk is."""

    local_readers: int = 1
    remote_readers: int = 0
    max_chunk_bytes: int = 24 * 1024 * 1024
    max_chunks: int = 10  # MessageQueue's default; the ring is max_chunks x max_chunk_bytes of /dev/shm
    # Remote readers connect over TCP here; never 127.0.0.1, which Ray rewrites.
    remote_ip: str = "127.0.0.2"
    # vLLM 0.32's shared-memory tensor arena (local readers only: vLLM ignores it otherwise)
    arena: bool = False

    @property
    def readers(self) -> int:
        return self.local_readers + self.remote_readers


@dataclass(frozen=True)
class ItemReport:
    """What a reader saw of one tensor or array of a message."""

    kind: str  # "tensor" or "ndarray"
    type_name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    writable: bool
    requires_grad: bool = False
    is_conj: bool = False


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    plain = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return plain.view(torch.uint8).numpy().tobytes() if plain.numel() else b""


def describe_item(value: Any, writable: bool = True) -> ItemReport:
    """Return the report of one tensor or array (the writer's side of the check)."""
    if isinstance(value, torch.Tensor):
        return ItemReport(
            kind="tensor",
            type_name=type(value).__name__,
            dtype=str(value.dtype),
            shape=tuple(value.shape),
            digest=hashlib.sha256(_tensor_bytes(value)).hexdigest(),
            writable=writable,
            requires_grad=value.requires_grad,
            is_conj=value.is_conj(),
        )
    array = np.asarray(value)
    return ItemReport(
        kind="ndarray",
        type_name=type(value).__name__,
        dtype=str(array.dtype),
        shape=tuple(array.shape),
        digest=hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
        writable=writable and bool(array.flags.writeable),
    )


def describe(payload: dict[str, Any]) -> dict[str, ItemReport]:
    """Return reports of every tensor or array in a flat ``{name: value}`` payload."""
    return {name: describe_item(value) for name, value in payload.items()}


def _writable_in_place(tensor: torch.Tensor) -> bool:
    """Write the first element back onto itself; False if torch refuses."""
    if tensor.numel() == 0:
        return True
    try:
        with torch.no_grad():
            flat = tensor.detach().reshape(-1)
            flat[:1].copy_(flat[:1].clone())
        return True
    except RuntimeError:
        return False


def _drop(kept: list[dict[str, Any]], index: int) -> None:
    kept[index] = {}  # the last reference: the storage (and an arena slot's view) is freed now


def _write(kept: list[dict[str, Any]], index: int) -> None:
    for value in kept[index].values():
        with torch.no_grad():
            value.fill_(1)  # a reader that computes in place on what it received


def _write_every_other_page(kept: list[dict[str, Any]], index: int) -> None:
    for value in kept[index].values():
        with torch.no_grad():
            value.reshape(-1).view(torch.uint8)[::2 * 4096].fill_(1)  # one byte in every other page


def _drop_all(kept: list[dict[str, Any]], index: int) -> None:
    kept[:] = [{} for _ in kept]  # many frees at once, before the reader's next dequeue


def _keep_view_of_view(kept: list[dict[str, Any]], index: int) -> None:
    kept[index] = {name: view_of_view(value) for name, value in kept[index].items()}


def view_of_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a strided view of a view of ``tensor`` (what a reader may keep of a message)."""
    return tensor.reshape(-1)[8:][::3]


# What a ``keep`` reader can be told to do with one kept message (``MessageQueueHarness.control``).
# ``drop-all`` ignores the index: it frees every kept message at once.
READER_ACTIONS = {"drop": _drop, "drop-all": _drop_all, "write": _write,
                  "write-every-other-page": _write_every_other_page, "view-of-view": _keep_view_of_view}


def _receive(mq: Any, timeout: float, wire_report: bool) -> tuple[Any, list[int] | None]:
    """Return the next message and, for ``wire_report``, the sizes of its ZMQ frames."""
    if not wire_report:
        return mq.dequeue(timeout=timeout), None
    # Same steps as MessageQueue.recv, keeping the frames to measure them.
    if not mq.remote_socket.poll(timeout=int(timeout * 1000)):
        raise TimeoutError(f"no message within {timeout} s")
    frames = mq.remote_socket.recv_multipart(copy=False)
    sizes = [memoryview(f).nbytes for f in frames]
    return pickle.loads(frames[0], buffers=frames[1:]), sizes


PAGE = 4096


def touch_pages(payload: dict[str, Any]) -> int:
    """Read one byte of every page of every tensor in ``payload`` (what a consumer pays before it can
    use a zero-copy view: the page faults of a mapping, none for bytes already copied in)."""
    total = 0
    for value in payload.values():
        if isinstance(value, torch.Tensor) and value.numel():
            total += int(value.detach().reshape(-1).view(torch.uint8)[::PAGE].sum())
    return total


# Reader processes are forked from a server that imported these once (``multiprocessing``'s
# forkserver): a spawned reader imports vLLM and torch again, seconds each, where a forked one starts
# in milliseconds, and every MessageQueue component test starts its own. The server is a fresh
# interpreter (it never sees the modes this process applies), so readers run vLLM as installed;
# each takes the writer's environment at its start.
READER_PRELOAD = ["vllm.distributed.device_communicators.shm_broadcast", __name__]


def reader_context() -> Any:
    """The ``multiprocessing`` context readers start in: a fork of a server with vLLM imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(READER_PRELOAD)
    return ctx


def _reader_main(handle: Any, rank: int, results: Any, timeout: float | None, wire_report: bool,
                 ack_only: bool = False, cpus: frozenset[int] | None = None, keep: bool = False,
                 touch: bool = False, environ: dict[str, str] | None = None, delay: float = 0.0) -> None:
    if environ is not None:  # the writer's, now (the fork server kept the one it started with)
        os.environ.clear()
        os.environ.update(environ)
    if cpus:  # before any thread starts: ZMQ's I/O threads inherit it
        os.sched_setaffinity(0, cpus)
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    long_waits = _count_long_waits(shm_broadcast)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    kept: list[dict[str, Any]] = []  # as a scheduler keeps what it received
    while True:
        if delay:  # a slow worker: busy elsewhere before each read, while the writer goes on
            time.sleep(delay)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            try:
                payload, frame_sizes = _receive(mq, timeout, wire_report)
            except Exception as exc:  # say why, rather than die silently: the test's failure names it
                results.put((rank, {READ_ERROR: f"{type(exc).__name__}: {exc}",
                                    WAITED_S: time.monotonic() - started, LONG_WAITS: long_waits.count}))
                return
        if isinstance(payload, str) and payload == _STOP:
            return
        if isinstance(payload, tuple) and payload and payload[0] == _CONTROL:
            _, action, target, index = payload
            if target in (None, rank):
                READER_ACTIONS[action](kept, index)
            results.put((rank, {"done": action}))
            continue
        if isinstance(payload, str) and payload == _WAITS:
            results.put((rank, {WAITED_S: time.monotonic() - started, LONG_WAITS: long_waits.count}))
            continue
        if isinstance(payload, str) and payload == _RECHECK:
            results.put((rank, {f"{i}/{name}": describe_item(value)
                                for i, message in enumerate(kept) for name, value in message.items()}))
            continue
        if keep:
            kept.append(payload)
        if frame_sizes is not None:
            results.put((rank, {"frames": frame_sizes}))
            continue
        if ack_only:  # benchmarks: when the message was rebuilt (loads; ``touch``: and every page read)
            if touch:
                touch_pages(payload)
            results.put((rank, {RECEIVED_AT: time.perf_counter()}))
            continue
        not_writable = any("not writable" in str(w.message) for w in caught)
        report = {}
        for name, value in payload.items():
            ok = not not_writable
            if isinstance(value, torch.Tensor):
                ok = ok and _writable_in_place(value)
            report[name] = describe_item(value, writable=ok)
        results.put((rank, report))


class _LongWaitCounter(logging.Handler):
    """Counts vLLM's "no available shared memory broadcast block" lines of one logger."""

    def __init__(self, message: str) -> None:
        super().__init__(logging.DEBUG)
        self.message, self.count = message, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.msg == self.message


def _count_long_waits(shm_broadcast: Any) -> _LongWaitCounter:
    """Count the long-wait lines ``shm_broadcast`` logs from now on. The fork server imported it under its own
    environment: the interval it read then is read again here, from this reader's, as a fresh worker would."""
    from vllm import envs

    shm_broadcast.VLLM_RINGBUFFER_WARNING_INTERVAL = envs.VLLM_RINGBUFFER_WARNING_INTERVAL
    counter = _LongWaitCounter(getattr(shm_broadcast, "LONG_WAIT_TIME_LOG_MSG", None))
    shm_broadcast.logger.addHandler(counter)
    shm_broadcast.logger.setLevel(min(shm_broadcast.logger.getEffectiveLevel(), logging.INFO))
    return counter


# Key of a threaded reader's report: ``[(thread, message), ...]``, every message any of its threads got.
THREAD_READS = "thread_reads"
# Key of a threaded reader's report: what its threads raised, one line each.
THREAD_ERRORS = "thread_errors"


def _threaded_reader_main(handle: Any, rank: int, results: Any, timeout: float, threads: int,
                          mode: PatchMode, environ: dict[str, str], delay: float = 0.0) -> None:
    """A local reader whose ``threads`` threads all dequeue from one ``MessageQueue`` (the use upstream
    vLLM report 50398 describes): each thread reads until a stop message or ``timeout`` s idle, then
    the process reports everything its threads got. ``delay``: seconds each thread spends before
    each read (a consumer's work; the writer fills the ring meanwhile). The mode is applied here,
    as every vLLM process applies it (``plugins/general.py``): the testbed's serializes ``dequeue``."""
    os.environ.clear()
    os.environ.update(environ)
    broadcast.apply(mode)
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    reads: list[tuple[int, Any]] = []  # list.append holds the GIL: no message of ours is lost here
    errors: list[str] = []

    def consume(thread: int) -> None:
        while True:
            if delay:
                time.sleep(delay)
            try:
                payload = mq.dequeue(timeout=timeout)
            except TimeoutError:
                return  # idle: the writer stopped, or this thread waits on a slot nobody writes
            except Exception as exc:  # a torn read: the failure names it
                errors.append(f"thread {thread}: {type(exc).__name__}: {exc}")
                return
            if isinstance(payload, str) and payload == _STOP:
                return
            reads.append((thread, payload))

    workers = [threading.Thread(target=consume, args=(t,), name=f"testbed-mq-dequeue-{t}", daemon=True)
               for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put((rank, {THREAD_READS: reads, THREAD_ERRORS: errors}))


class MessageQueueHarness:
    """One writer in this process and ``topology.readers`` reader processes."""

    def __init__(
        self,
        topology: QueueTopology,
        mode: PatchMode,
        timeout: float = 60.0,
        arena_mode: PatchMode = PatchMode.TESTBED,
        wire_report: bool = False,
        ack_only: bool = False,
        remote_reader_cpus: frozenset[int] | None = None,
        keep: bool = False,
        touch: bool = False,
        delays: dict[int, float] | None = None,
        reader_threads: int = 1,
        read_deadline: bool = True,
    ) -> None:
        """``delays``: seconds reader ``rank`` spends before each read (a slow worker; the
        writer does not wait for reports between ``send`` calls, so it runs ahead of it).
        ``read_deadline`` False: readers dequeue with ``timeout=None`` (no deadline; vLLM still logs
        its long-wait line each interval), local readers only.
        ``reader_threads`` > 1: each local reader dequeues from that many threads and reports once,
        at the end (``thread_reads``)."""
        if reader_threads > 1 and topology.remote_readers:
            raise ValueError("reader_threads shares one reader's ring cursor: local readers only")
        self.reader_threads = reader_threads
        if not read_deadline and topology.remote_readers:
            raise ValueError("read_deadline=False waits on the ring: local readers only")
        self.read_deadline = read_deadline
        if wire_report and topology.local_readers:
            raise ValueError("wire_report measures ZMQ frames: remote readers only")
        self.wire_report = wire_report
        self.ack_only = ack_only
        self.remote_reader_cpus = remote_reader_cpus
        self.keep = keep
        self.touch = touch
        self.delays = dict(delays or {})
        self.topology = topology
        self.mode = mode
        self.arena_mode = arena_mode
        self.timeout = timeout
        self._ctx = reader_context()
        # One results queue per reader: a queue's put holds a lock shared by every process that
        # writes to it, and a reader SIGKILLed while holding it (``kill_reader``) would block the
        # others' reports for good (seen: a surviving reader's answer never came, 1 run in 2).
        self._results = {rank: self._ctx.Queue() for rank in range(1, topology.readers + 1)}
        self._readers: list[mp.process.BaseProcess] = []
        self.writer: Any = None

    def __enter__(self) -> "MessageQueueHarness":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        arena.apply(self.arena_mode)  # first: broadcast composes enqueue with the arena's guard
        broadcast.apply(self.mode)
        topo = self.topology
        self.writer = MessageQueue(
            n_reader=topo.readers,
            n_local_reader=topo.local_readers,
            local_reader_ranks=list(range(1, topo.local_readers + 1)),
            max_chunk_bytes=topo.max_chunk_bytes,
            max_chunks=topo.max_chunks,
            connect_ip=topo.remote_ip,
            **({"enable_shm_tensor_arena": True} if topo.arena else {}),
        )
        handle = self.writer.export_handle()
        try:
            for rank in range(1, topo.readers + 1):
                cpus = self.remote_reader_cpus if rank > topo.local_readers else None
                read_timeout = self.timeout if self.read_deadline else None
                target, args = _reader_main, (handle, rank, self._results[rank], read_timeout, self.wire_report,
                                              self.ack_only, cpus, self.keep, self.touch, dict(os.environ),
                                              self.delays.get(rank, 0.0))
                if self.reader_threads > 1:
                    target, args = _threaded_reader_main, (handle, rank, self._results[rank], self.timeout,
                                                           self.reader_threads, self.mode, dict(os.environ),
                                                           self.delays.get(rank, 0.0))
                proc = self._ctx.Process(
                    target=target,
                    args=args,
                    name=f"testbed-mq-reader-{rank}",
                    daemon=True,
                )
                proc.start()
                self._readers.append(proc)
            self.writer.wait_until_ready()
        except BaseException:
            self._stop_readers()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop_readers()

    @property
    def reader_pids(self) -> list[int]:
        return [p.pid for p in self._readers if p.pid is not None and p.is_alive()]  # a killed one's pid is reused

    def pause_readers(self) -> None:
        """SIGSTOP every reader: their ZMQ I/O threads stop draining the sockets."""
        for pid in self.reader_pids:
            os.kill(pid, signal.SIGSTOP)

    def resume_readers(self) -> None:
        for pid in self.reader_pids:
            os.kill(pid, signal.SIGCONT)

    def kill_reader(self, rank: int) -> None:
        """SIGKILL reader ``rank`` (1-based) and reap it: a worker that dies holding what it received."""
        proc = self._readers[rank - 1]
        proc.kill()
        proc.join(timeout=10)

    def send(self, payload: Any) -> None:
        self.writer.enqueue(payload, timeout=self.timeout)

    def control(self, action: str, index: int, rank: int | None = None,
                ranks: set[int] | None = None) -> None:
        """Tell ``keep`` reader ``rank`` (None: every reader) to ``action`` its kept message ``index``
        (``READER_ACTIONS``); return once the readers in ``ranks`` (default all) acknowledged."""
        if action not in READER_ACTIONS:
            raise ValueError(f"unknown reader action {action!r}; use one of {sorted(READER_ACTIONS)}")
        if not self.keep:
            raise ValueError("reader actions work on kept messages: create the harness with keep=True")
        self.send((_CONTROL, action, rank, index))
        self.collect(ranks=ranks)

    def arena_slots(self) -> list[str]:
        """The writer's arena slots now (``arena.slot_states``); empty without an arena."""
        tensor_arena = getattr(self.writer, "tensor_arena", None)
        return arena.slot_states(tensor_arena) if tensor_arena is not None else []

    def collect(self, within: float | None = None, ranks: set[int] | None = None) -> dict[int, dict[str, Any]]:
        """Return each reader's report of the next message (``ack_only``: ``{RECEIVED_AT: t}``);
        raise if one is late (``within`` seconds, default the harness timeout) or dead. ``ranks``:
        wait for these readers only (others killed on purpose)."""
        within = self.timeout if within is None else within
        deadline = time.monotonic() + within
        wanted = set(range(1, self.topology.readers + 1)) if ranks is None else set(ranks)
        reports: dict[int, dict[str, Any]] = {}
        while not wanted <= set(reports):
            for rank in sorted(wanted - set(reports)):
                try:
                    _, reports[rank] = self._results[rank].get(
                        timeout=max(0.01, min(0.2, deadline - time.monotonic())))
                except queue.Empty:
                    # only the awaited readers: one killed on purpose (``ranks`` leaves it out) is no failure
                    dead = [p.name for r, p in enumerate(self._readers, 1) if r in wanted and not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        raise TimeoutError(
                            f"readers answered {sorted(reports)} of {sorted(wanted)} "
                            f"within {within} s; dead: {dead or 'none'}"
                        ) from None
        return {rank: report for rank, report in reports.items() if rank in wanted}

    def broadcast(self, payload: dict[str, Any]) -> dict[int, dict[str, ItemReport]]:
        self.send(payload)
        return self.collect()

    def thread_reads(self) -> dict[int, dict[str, Any]]:
        """Stop a ``reader_threads`` harness's threads (one stop message each, while the ring takes
        them) and return each reader's report: ``{THREAD_READS: [(thread, message)], THREAD_ERRORS: [...]}``."""
        for _ in range(self.reader_threads * self.topology.readers):
            try:
                self.writer.enqueue(_STOP, timeout=self.timeout)
            except TimeoutError:
                break  # the readers stopped reading: their threads end on their idle timeout
        return self.collect(within=2 * self.timeout + 10)

    def waits(self) -> dict[int, dict[str, Any]]:
        """Send a message each reader answers with how long its read of it waited (``WAITED_S``) and
        how many of vLLM's long-wait lines it has logged (``LONG_WAITS``)."""
        self.send(_WAITS)
        return self.collect()

    def recheck(self) -> dict[int, dict[str, ItemReport]]:
        """Return each ``keep`` reader's report, now, of every message it kept (``"<index>/<name>"``)."""
        if not self.keep:
            raise ValueError("recheck reports what readers kept: create the harness with keep=True")
        self.send(_RECHECK)
        return self.collect()

    def _stop_readers(self) -> None:
        self.resume_readers()
        if self.writer is not None and any(p.is_alive() for p in self._readers):
            try:
                self.writer.enqueue(_STOP, timeout=5.0)
            except Exception as exc:  # readers may already be gone
                logger.debug("stop message not delivered: %s", exc)
        for proc in self._readers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._readers.clear()
        self.writer = None
