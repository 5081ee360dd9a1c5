"""What each broadcast mode costs per message, beside a memcpy of the same bytes.

One writer (this process) and reader processes, through the real
``MessageQueue``: 1, 2 or 4 local readers over the shared-memory ring (or its
overflow socket when a message exceeds the 24 MiB chunk), or 1, 2 or 4 remote
readers over TCP on 127.0.0.2. Per message: from ``enqueue`` until the last reader had
it rebuilt (the readers' own ``perf_counter``, the same monotonic clock on one
host; the acknowledgement's way back is not counted), and how long ``enqueue``
itself held the writer. The remote reader stands for another host, so it gets
CPUs of its own: the writer's threads run on the first half of this process's
CPUs and the readers on the other half (with 2 CPUs: one each, as the cluster
pins one core per node; 2 or 4 remote readers share theirs); unpinned, the writer's wake-ups compete with the
reader's on the same cores, which no two hosts do. ``upstream`` and
``testbed`` take turns message by message on the same writer and readers (the
mode is switched in the writer between messages; readers run vLLM's
``dequeue`` whatever it is), so the race fix's cost is a ratio of messages sent
in the same round (with its 95% interval, and beside ``upstream`` against
itself: its odd rounds over its even ones, the machine's noise); ``off`` follows in its own block on the same processes: its
in-band messages (2-8x heavier) slowed the next one or two messages of any
mode, which biased the pairs when it took turns with them. Each figure is
repeated until stable and shown with the memcpy time of the same bytes,
measured in the same run.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from vllm_zerocopy_testbed.bench.stats import Ratio, Sample, interleaved, memcpy, paired, sample, self_ratio
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import RECEIVED_AT, MessageQueueHarness, QueueTopology
from vllm_zerocopy_testbed.patches import broadcast

KiB, MiB = 1 << 10, 1 << 20
TOPOLOGIES = {
    "local-1": QueueTopology(local_readers=1),
    "local-2": QueueTopology(local_readers=2),
    "local-4": QueueTopology(local_readers=4),
    "remote-1": QueueTopology(local_readers=0, remote_readers=1),
    "remote-2": QueueTopology(local_readers=0, remote_readers=2),
    "remote-4": QueueTopology(local_readers=0, remote_readers=4),
}
FULL_SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (1 * MiB, 16 * MiB)
PAIRED = (PatchMode.UPSTREAM, PatchMode.TESTBED)  # take turns; OFF runs in a block of its own
MODES = (PatchMode.OFF, *PAIRED)


@dataclass(frozen=True)
class BroadcastFigure:
    """One (topology, size, mode) cell."""

    topology: str
    nbytes: int
    mode: str
    message: Sample
    enqueue_ms: float
    memcpy: Sample
    # Round-by-round ratio to upstream (messages of the same round): median and spread.
    vs_upstream: float | None = None
    vs_upstream_spread: float | None = None
    # testbed: that ratio's median with its 95% interval; and upstream against itself (the noise)
    ratio: Ratio | None = None
    noise: Ratio | None = None

    @property
    def ratio_to_memcpy(self) -> float:
        return self.message.median_ms / self.memcpy.median_ms


def host_cpus() -> tuple[frozenset[int], frozenset[int]] | None:
    """Split this process's CPUs into the writer's host and the remote reader's (None if < 2)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


@contextlib.contextmanager
def threads_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run every thread of this process on ``cpus`` (None: as is); restore each thread's CPUs after."""
    if cpus is None:
        yield
        return
    before = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        process_cpus = before.get(os.getpid(), frozenset(range(os.cpu_count() or 1)))
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, process_cpus))


@contextlib.contextmanager
def one_copy_thread() -> Iterator[None]:
    """Run this process's torch copies on one thread (restored after), as the memcpy they are
    measured against (``stats.memcpy``) runs. With torch's 2 threads on 2 cores, the second waits for a
    core that a polling local reader holds: vLLM's 8 MiB slot write read 6.7 ms beside 2 arena
    readers (one thread: 1.39 ms; the 2-thread memcpy alone 0.32 ms), in some runs and not others."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(topology: str, sizes: tuple[int, ...], *, budget_s: float, baselines: dict[int, Sample],
            progress: Callable[[BroadcastFigure], None]) -> list[BroadcastFigure]:
    """Measure every size and mode for one topology with one set of reader processes."""
    figures = []
    topo = TOPOLOGIES[topology]
    split = host_cpus() if topo.remote_readers else None
    writer_cpus, reader_cpus = split if split else (None, None)
    with threads_on(writer_cpus), MessageQueueHarness(topo, PatchMode.UPSTREAM, timeout=120, ack_only=True,
                                                      remote_reader_cpus=reader_cpus) as harness:
        try:
            # Fresh reader processes are slow for their first messages (imports, first touch).
            small, until = torch.randn(16 * KiB), time.monotonic() + 1.0
            while time.monotonic() < until:
                harness.send({"prompt_embeds": small})
                harness.collect()
            for nbytes in sizes:
                tensor = torch.randn(nbytes // 4)
                held: dict[PatchMode, list[float]] = {mode: [] for mode in MODES}

                def timer(mode: PatchMode) -> Callable[[], float]:
                    def once() -> float:
                        broadcast.apply(mode)
                        start = time.perf_counter()
                        harness.send({"prompt_embeds": tensor})
                        held[mode].append((time.perf_counter() - start) * 1e3)
                        received = max(report[RECEIVED_AT] for report in harness.collect().values())
                        return (received - start) * 1e3
                    return once

                timers = {mode: timer(mode) for mode in MODES}
                for once in list(timers.values()) * 2:  # warm-up: first touch of ring and buffers
                    once()
                for values in held.values():
                    values.clear()
                times = interleaved({m: timers[m] for m in PAIRED}, min_n=7, max_n=400,
                                    budget_s=budget_s * len(PAIRED))
                times.update(interleaved({PatchMode.OFF: timers[PatchMode.OFF]}, min_n=7, max_n=400,
                                         budget_s=budget_s))
                base = times[PatchMode.UPSTREAM]
                for mode in MODES:
                    message = sample(times[mode])
                    pair = paired(times[mode], base) if mode is PatchMode.TESTBED else None
                    if mode in PAIRED:
                        ratio, ratio_spread = (pair.median, pair.spread) if pair else (1.0, 0.0)
                    else:  # not the same rounds: a ratio of medians, no spread of its own
                        ratio, ratio_spread = message.median_ms / sample(base).median_ms, None
                    figure = BroadcastFigure(topology, nbytes, mode.value, message, sample(held[mode]).median_ms,
                                             baselines[nbytes], ratio, ratio_spread, pair,
                                             self_ratio(base) if pair else None)
                    figures.append(figure)
                    progress(figure)
        finally:
            broadcast.apply(PatchMode.UPSTREAM)
    return figures


def memcpy_floors(sizes: set[int], *, quick: bool) -> dict[int, Sample]:
    """The memcpy of each size, measured before any reader process starts: beside waiting or
    exiting readers the same copy takes several times as long."""
    return {n: memcpy(n, 1.0 if quick else 2.0) for n in sorted(sizes)}


def sizes(quick: bool) -> tuple[int, ...]:
    return QUICK_SIZES if quick else FULL_SIZES


def run(*, quick: bool, baselines: dict[int, Sample], progress: Callable[[BroadcastFigure], None]
        ) -> list[BroadcastFigure]:
    """Run the grid: every topology (quick: local-1 and remote-1) and size, the modes interleaved;
    ``baselines``: the memcpy of each size (``memcpy_floors``)."""
    topologies = ("local-1", "remote-1") if quick else tuple(TOPOLOGIES)
    budget = 1.5 if quick else 2.0
    figures = []
    for topology in topologies:
        figures += measure(topology, sizes(quick), budget_s=budget, baselines=baselines, progress=progress)
    return figures
