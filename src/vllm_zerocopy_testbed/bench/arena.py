"""vLLM 0.32's shared-memory tensor arena per arena mode, beside a memcpy of the same bytes.

One writer (this process) and 1, 2 or 4 local reader processes through one real ``MessageQueue``
with ``enable_shm_tensor_arena=True`` (vLLM's 24 MiB ring chunk). A message is one CPU tensor of
8-256 MiB; it counts from ``enqueue`` until the last reader had it rebuilt and had read one byte of
every page (``touch``): a zero-copy view costs nothing until it is read, and a mapping's page
faults are its price. The writer switches ``TESTBED_ARENA`` between messages (the stub it pickles
names the rebuild):

* ``arena upstream`` / ``arena testbed``: the writer copies the tensor once into a slot; readers
  view it (vLLM's shared view, or the testbed's private copy-on-write mapping, kept per slot).
  The two take turns message by message on the same writer and readers.
* ``arena off``: the pickler ignores the arena, as before vLLM 0.32: the tensor goes out of band
  (into the ring up to its 24 MiB chunk, over the local ZMQ socket above). In a block of its own
  after the pair, as the broadcast part's ``off`` (its heavier messages slow the next ones).

Where the time goes, measured in the same run: ``slot write``, the writer's copy into the slot
(vLLM's ``write_tensor``; the testbed points it at the free slot written last, still in the
caches, where vLLM's round robin takes the coldest: taking turns with it, the testbed's slots are
the ones vLLM's writes just left, so this part understates the difference); and the queue's
``floor``, a message of one 4 KiB tensor on the same queue and readers (what any message costs).

Goal: the arena within 2x of a memcpy of the same bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_zerocopy_testbed.bench.stats import Ratio, Sample, interleaved, paired, sample, self_ratio, until_stable
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import RECEIVED_AT, MessageQueueHarness, QueueTopology
from vllm_zerocopy_testbed.patches import arena

MiB = 1 << 20
FULL_SIZES = (8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (8 * MiB, 64 * MiB)
ARENA_MODES = (PatchMode.UPSTREAM, PatchMode.TESTBED)  # take turns; OFF runs in a block of its own
GOAL_X_MEMCPY = 2.0
FLOOR_BYTES = 4096


@dataclass(frozen=True)
class ArenaFigure:
    """One (readers, size, transport) cell."""

    readers: int
    nbytes: int
    transport: str  # "arena upstream", "arena testbed", "arena off"
    message: Sample
    memcpy: Sample
    # arena testbed: round-by-round ratio to arena upstream (same rounds), and upstream against itself
    ratio: Ratio | None = None
    noise: Ratio | None = None
    slot_write_ms: float | None = None  # the writer's copy into the slot (arena modes)
    floor_ms: float | None = None  # a 4 KiB message on the same queue and readers

    @property
    def ratio_to_memcpy(self) -> float:
        return self.message.median_ms / self.memcpy.median_ms

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / (1 << 30) / (self.message.median_ms / 1e3)


def _harness(readers: int) -> MessageQueueHarness:
    topology = QueueTopology(local_readers=readers, arena=True)
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


def _timed_slot_writes(harness: MessageQueueHarness) -> dict[PatchMode, list[float]]:
    """Time every ``write_tensor`` of the writer's arena (ms), per arena mode in force, into the
    lists returned (the modes choose slots differently: vLLM's round robin, the testbed's warmest)."""
    tensor_arena = harness.writer.tensor_arena
    installed, times = tensor_arena.write_tensor, {mode: [] for mode in ARENA_MODES}

    def write_tensor(tensor: torch.Tensor) -> int | None:
        start = time.perf_counter()
        try:
            return installed(tensor)
        finally:
            times.setdefault(arena.active_mode(), []).append((time.perf_counter() - start) * 1e3)

    tensor_arena.write_tensor = write_tensor
    return times


def measure(readers: int, sizes: tuple[int, ...], *, budget_s: float, baselines: dict[int, Sample],
            progress: Callable[[ArenaFigure], None]) -> list[ArenaFigure]:
    """Every size and transport for ``readers`` local readers on one queue; ``baselines``: the
    memcpy of each size (``broadcast.memcpy_floors``)."""
    figures: list[ArenaFigure] = []
    try:
        with _harness(readers) as harness:
            floor_once = _timer(harness, torch.randn(FLOOR_BYTES // 4))
            _warm(floor_once, 20)
            floor = until_stable(floor_once, min_n=20, max_n=500, budget_s=budget_s).median_ms
            writes = _timed_slot_writes(harness)
            for nbytes in sizes:
                tensor = torch.randn(nbytes // 4)
                timers = {mode: _timer(harness, tensor, before=lambda m=mode: arena.apply(m))
                          for mode in (*ARENA_MODES, PatchMode.OFF)}
                for once in timers.values():
                    _warm(once)
                for values in writes.values():
                    values.clear()
                times = interleaved({m: timers[m] for m in ARENA_MODES}, min_n=7, max_n=300,
                                    budget_s=budget_s * len(ARENA_MODES))
                slot_write = {m: sample(writes[m]).median_ms if writes.get(m) else None for m in ARENA_MODES}
                times.update(interleaved({PatchMode.OFF: timers[PatchMode.OFF]}, min_n=7, max_n=300,
                                         budget_s=budget_s))
                base = times[PatchMode.UPSTREAM]
                for mode in (*ARENA_MODES, PatchMode.OFF):
                    testbed = mode is PatchMode.TESTBED
                    figure = ArenaFigure(readers, nbytes, f"arena {mode.value}", sample(times[mode]),
                                         baselines[nbytes], paired(times[mode], base) if testbed else None,
                                         self_ratio(base) if testbed else None,
                                         slot_write.get(mode), floor)
                    figures.append(figure)
                    progress(figure)
    finally:
        arena.apply(PatchMode.TESTBED)
    return figures


def sizes(quick: bool) -> tuple[int, ...]:
    return QUICK_SIZES if quick else FULL_SIZES


def run(*, quick: bool, baselines: dict[int, Sample], progress: Callable[[ArenaFigure], None]) -> list[ArenaFigure]:
    """The grid: 1, 2 and 4 readers (quick: 2), 8-256 MiB (quick: 8 and 64 MiB), every transport;
    ``baselines``: the memcpy of each size, measured before any reader started."""
    budget = 1.0 if quick else 2.0
    figures = []
    for readers in ((2,) if quick else (1, 2, 4)):
        figures += measure(readers, sizes(quick), budget_s=budget, baselines=baselines, progress=progress)
    return figures
