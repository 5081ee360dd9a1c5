"""What each broadcast mode costs per message, beside a memcpy of the same bytes.

One writer (this process) and reader processes, through the real
``MessageQueue``: 1 to 3 local readers over the shared-memory ring (or its
overflow socket when a message exceeds the 24 MiB chunk), or one remote reader
over TCP on 127.0.0.2. Per message: from ``enqueue`` until every reader has
rebuilt it, and how long ``enqueue`` itself held the writer. Each figure is
repeated until stable and shown with the memcpy time of the same bytes,
measured in the same run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_zerocopy_testbed.bench.stats import Sample, until_stable
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import MessageQueueHarness, QueueTopology

KiB, MiB = 1 << 10, 1 << 20
TOPOLOGIES = {
    "local-1": QueueTopology(local_readers=1),
    "local-2": QueueTopology(local_readers=2),
    "local-3": QueueTopology(local_readers=3),
    "remote-1": QueueTopology(local_readers=0, remote_readers=1),
}
FULL_SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (1 * MiB, 16 * MiB)
MODES = (PatchMode.OFF, PatchMode.UPSTREAM, PatchMode.TESTBED)


@dataclass(frozen=True)
class BroadcastFigure:
    """One (topology, size, mode) cell."""

    topology: str
    nbytes: int
    mode: str
    message: Sample
    enqueue_ms: float
    memcpy: Sample

    @property
    def ratio_to_memcpy(self) -> float:
        return self.message.median_ms / self.memcpy.median_ms


def memcpy(nbytes: int, budget_s: float) -> Sample:
    """Time copying ``nbytes`` between two pre-touched buffers (the physical floor of a copy)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

    def once() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - start) * 1e3

    return until_stable(once, min_n=7, max_n=200, budget_s=budget_s)


def measure(topology: str, sizes: tuple[int, ...], mode: PatchMode, *, budget_s: float,
            baselines: dict[int, Sample], progress: Callable[[BroadcastFigure], None]) -> list[BroadcastFigure]:
    """Measure every size for one topology and mode with one set of reader processes."""
    figures = []
    with MessageQueueHarness(TOPOLOGIES[topology], mode, timeout=120, ack_only=True) as harness:
        # Fresh reader processes are slow for their first messages (imports, first touch): without
        # this, the first size of each mode measured up to 2.7x apart on the same code path.
        small, until = torch.randn(16 * KiB), time.monotonic() + 1.0
        while time.monotonic() < until:
            harness.send({"prompt_embeds": small})
            harness.collect()
        for nbytes in sizes:
            tensor = torch.randn(nbytes // 4)
            held: list[float] = []

            def once() -> float:
                start = time.perf_counter()
                harness.send({"prompt_embeds": tensor})
                held.append((time.perf_counter() - start) * 1e3)
                harness.collect()
                return (time.perf_counter() - start) * 1e3

            for _ in range(2):  # warm-up: first-touch of ring and buffers
                once()
            held.clear()
            sample = until_stable(once, min_n=5, max_n=15, budget_s=budget_s)
            figure = BroadcastFigure(topology, nbytes, mode.value, sample, sorted(held)[len(held) // 2],
                                     baselines[nbytes])
            figures.append(figure)
            progress(figure)
    return figures


def run(*, quick: bool, progress: Callable[[BroadcastFigure], None]) -> list[BroadcastFigure]:
    """Run the grid: every topology (quick: local-1 and remote-1), size and mode."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    topologies = ("local-1", "remote-1") if quick else tuple(TOPOLOGIES)
    budget = 1.5 if quick else 3.0
    baselines = {n: memcpy(n, budget) for n in sizes}
    figures = []
    for topology in topologies:
        for mode in MODES:
            figures += measure(topology, sizes, mode, budget_s=budget, baselines=baselines, progress=progress)
    return figures
