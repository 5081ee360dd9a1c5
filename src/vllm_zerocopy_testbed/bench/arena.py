"""vLLM 0.32's shared-memory tensor arena beside the other local transports and a memcpy (issue 23).

One writer (this process) and 1-3 local reader processes through the real ``MessageQueue``.
A message is one CPU tensor of 8-256 MiB; it counts from ``enqueue`` until the last reader had
it rebuilt and had read one byte of every page (``touch``): a zero-copy view costs nothing until
it is read, and a mapping's page faults are its price. Transports, each on its own queue:

* ``arena upstream`` / ``arena testbed``: ``enable_shm_tensor_arena=True``: the writer copies the
  tensor once into a slot; readers map it (vLLM's shared view, or the testbed's private
  copy-on-write mapping). The two take turns message by message on one writer and one set of
  readers (the arena mode is switched in the writer: the stub it pickles names the rebuild).
* ``ring``: no arena, a ring chunk as large as the message (``VLLM_MQ_MAX_CHUNK_BYTES_MB``
  raised to fit; vLLM's default 24 MiB takes only the 8 and 16 MiB cells): the writer copies
  into the ring, each reader copies out.
* ``overflow``: no arena, 1 MiB chunks: the tensor goes out of band over the local ZMQ socket.

Goal (issue 23): the arena within 2x of a memcpy of the same bytes (measured in the same run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_zerocopy_testbed.bench.broadcast import memcpy
from vllm_zerocopy_testbed.bench.stats import Sample, interleaved, paired_ratio, sample, until_stable
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import RECEIVED_AT, MessageQueueHarness, QueueTopology
from vllm_zerocopy_testbed.patches import arena

MiB = 1 << 20
FULL_SIZES = (8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (8 * MiB, 64 * MiB)
ARENA_MODES = (PatchMode.UPSTREAM, PatchMode.TESTBED)
GOAL_X_MEMCPY = 2.0


@dataclass(frozen=True)
class ArenaFigure:
    """One (readers, size, transport) cell."""

    readers: int
    nbytes: int
    transport: str  # "arena upstream", "arena testbed", "ring", "overflow"
    message: Sample
    memcpy: Sample
    # arena testbed only: round-by-round ratio to arena upstream (same rounds), and its spread
    vs_upstream: float | None = None
    vs_upstream_spread: float | None = None

    @property
    def ratio_to_memcpy(self) -> float:
        return self.message.median_ms / self.memcpy.median_ms

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / (1 << 30) / (self.message.median_ms / 1e3)


def _harness(readers: int, *, arena_on: bool, chunk: int) -> MessageQueueHarness:
    topology = QueueTopology(local_readers=readers, max_chunk_bytes=chunk, arena=arena_on)
    return MessageQueueHarness(topology, PatchMode.UPSTREAM, timeout=120, ack_only=True, touch=True)


def _timer(harness: MessageQueueHarness, tensor: torch.Tensor, before: Callable[[], None] = lambda: None
           ) -> Callable[[], float]:
    def once() -> float:
        before()
        start = time.perf_counter()
        harness.send({"x": tensor})
        received = max(report[RECEIVED_AT] for report in harness.collect().values())
        return (received - start) * 1e3
    return once


def _warm(once: Callable[[], float], times: int = 2) -> None:
    for _ in range(times):  # first touch of slots, ring chunks and buffers
        once()


def measure(readers: int, sizes: tuple[int, ...], *, budget_s: float, baselines: dict[int, Sample],
            progress: Callable[[ArenaFigure], None]) -> list[ArenaFigure]:
    """Every size and transport for ``readers`` local readers (one queue per transport); a size's
    memcpy is measured into ``baselines`` the first time it is met, beside warm readers."""
    figures: list[ArenaFigure] = []
    tensors = {n: torch.randn(n // 4) for n in sizes}

    def add(figure: ArenaFigure) -> None:
        figures.append(figure)
        progress(figure)

    try:
        with _harness(readers, arena_on=True, chunk=24 * MiB) as harness:
            for nbytes in sizes:
                timers = {mode: _timer(harness, tensors[nbytes], before=lambda m=mode: arena.apply(m))
                          for mode in ARENA_MODES}
                for once in timers.values():
                    _warm(once)
                if nbytes not in baselines:
                    # here, not before the run: measured up front, it once caught the previous part's
                    # readers exiting (8 MiB: 7.99 ms, against 0.17-0.26 ms on a quiet machine)
                    baselines[nbytes] = memcpy(nbytes, budget_s)
                times = interleaved(timers, min_n=7, max_n=300, budget_s=budget_s * len(ARENA_MODES))
                base = times[PatchMode.UPSTREAM]
                for mode in ARENA_MODES:
                    ratio, ratio_spread = paired_ratio(times[mode], base) if mode is PatchMode.TESTBED else (None, None)
                    add(ArenaFigure(readers, nbytes, f"arena {mode.value}", sample(times[mode]), baselines[nbytes],
                                    ratio, ratio_spread))
    finally:
        arena.apply(PatchMode.TESTBED)
    for transport, chunk in (("ring", max(sizes) + MiB), ("overflow", MiB)):
        with _harness(readers, arena_on=False, chunk=chunk) as harness:
            for nbytes in sizes:
                once = _timer(harness, tensors[nbytes])
                _warm(once)
                add(ArenaFigure(readers, nbytes, transport, until_stable(once, min_n=7, max_n=300, budget_s=budget_s),
                                baselines[nbytes]))
    return figures


def run(*, quick: bool, progress: Callable[[ArenaFigure], None]) -> list[ArenaFigure]:
    """The grid: 1-3 readers (quick: 2), 8-256 MiB (quick: 8 and 64 MiB), every transport."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    budget = 1.0 if quick else 2.5
    baselines: dict[int, Sample] = {}  # memcpy per size, measured at first use (``measure``)
    figures = []
    for readers in ((2,) if quick else (1, 2, 3)):
        figures += measure(readers, sizes, budget_s=budget, baselines=baselines, progress=progress)
    return figures
