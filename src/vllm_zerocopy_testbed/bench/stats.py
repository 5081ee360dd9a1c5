"""Repeat a measurement until it is stable: median, spread (IQR / median), a flag above 5%."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

STABLE_SPREAD = 0.05


@dataclass(frozen=True)
class Sample:
    """Medians of repeated timings (ms) and their spread."""

    median_ms: float
    spread: float
    n: int

    @property
    def unstable(self) -> bool:
        return self.spread > STABLE_SPREAD


def spread(values: list[float]) -> float:
    """Return the interquartile range over the median (0 for fewer than 4 values)."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def until_stable(measure: Callable[[], float], *, min_n: int, max_n: int, budget_s: float) -> Sample:
    """Call ``measure`` (returns ms) at least ``min_n`` times, then until the spread is <= 5%,
    ``max_n`` calls, or ``budget_s`` seconds, whichever comes first."""
    values: list[float] = []
    start = time.monotonic()
    while len(values) < max_n:
        values.append(measure())
        if len(values) >= min_n and (spread(values) <= STABLE_SPREAD or time.monotonic() - start > budget_s):
            break
    return Sample(statistics.median(values), spread(values), len(values))
