"""Repeat a measurement until it is stable: median, spread (IQR / median), a flag above 5%."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

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
    return sample(interleaved({"": measure}, min_n=min_n, max_n=max_n, budget_s=budget_s)[""])


def memcpy(nbytes: int, budget_s: float) -> Sample:
    """Time one copy of ``nbytes`` between two pre-touched buffers, on one thread (the least any
    copy of those bytes costs): the floor every part measures itself against."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)

    def once() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return (time.perf_counter() - start) * 1e3

    return until_stable(once, min_n=20, max_n=2000, budget_s=budget_s)


def sample(values: list[float]) -> Sample:
    return Sample(statistics.median(values), spread(values), len(values))


def interleaved(measures: dict[Any, Callable[[], float]], *, min_n: int, max_n: int,
                budget_s: float) -> dict[Any, list[float]]:
    """Run ``measures`` in rounds (each once per round, the order rotated every round) until
    each has ``min_n`` values and every spread is <= 5%, ``max_n`` rounds, or ``budget_s``.

    Interleaving puts every variant under the same drift (other processes, caches, clock),
    so the ratio of round ``i``'s values compares like with like."""
    names = list(measures)
    values: dict[Any, list[float]] = {name: [] for name in names}
    start = time.monotonic()
    for i in range(max_n):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            values[name].append(measures[name]())
        if i + 1 >= min_n and (all(spread(v) <= STABLE_SPREAD for v in values.values())
                               or time.monotonic() - start > budget_s):
            break
    return values


def paired_ratios(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """Return round-by-round ratios ``values[i] / base[i]`` (values measured in the same round)."""
    return [v / b for v, b in zip(values, base)]


def median_ci(values: Sequence[float]) -> tuple[float, float]:
    """Return a 95% confidence interval of the median of ``values``, free of any assumed
    distribution: the order statistics n/2 -+ 0.98 sqrt(n) (the binomial's normal approximation;
    with fewer than 6 values, the smallest and the largest)."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return ordered[0], ordered[-1]
    half = 0.98 * math.sqrt(n)
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


@dataclass(frozen=True)
class Ratio:
    """A ratio's median over rounds, its spread (IQR / median) and its median's 95% interval."""

    median: float
    spread: float
    low: float
    high: float
    n: int


def ratio_of(ratios: Sequence[float]) -> Ratio:
    low, high = median_ci(ratios)
    return Ratio(statistics.median(ratios), spread(list(ratios)), low, high, len(ratios))


def paired(values: Sequence[float], base: Sequence[float]) -> Ratio:
    """``values`` over ``base``, round by round (``paired_ratios``), as a ``Ratio``."""
    return ratio_of(paired_ratios(values, base))


def self_ratio(base: Sequence[float], period: int = 2) -> Ratio | None:
    """The machine's noise as a ratio: ``base`` against itself, each round over the round ``period``
    later (with ``period`` variants taking turns, rotated each round, the one where ``base`` held
    the same place: its place in a round moves its time by several percent); None below two pairs."""
    pairs = [(later, earlier) for start in range(0, len(base) - period, 2 * period)
             for earlier, later in zip(base[start:start + period], base[start + period:start + 2 * period])]
    if len(pairs) < 2:
        return None
    return ratio_of([later / earlier for later, earlier in pairs])
