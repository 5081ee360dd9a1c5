"""Latency: the cluster against the single-process reference interleaved with it, request by request.

Each cluster request is paired with the same request sent to the reference just
before it (``Runner.run(paired=...)``), so both are measured under the same load: a
CPU hog that slows every process alike moves both and leaves their ratio. Two
things are judged, both from ratios measured in the same run:

* slowdown: the median of the pairs' ratios (cluster / reference) stays within
  ``budget``: the whole cluster got slower than what PP x TP over Ray costs here
  (a slow broadcast path, a copy where there was none);
* stall: no request takes more than ``stall_factor`` times what the run predicts
  for it, and ``stall_floor_s`` more: one request held while its neighbours were
  not. The prediction is a line through the run's pairs (cluster = fixed cost +
  slope x reference, fitted by medians so that a stall moves neither): here a
  request costs the cluster ~1.5 s of its own (two stages, PP hops, all-reduces
  per token) whatever it is, so one ratio for all would call short requests slow.

Absolute speed goals stay in ``make bench``.
"""

from __future__ import annotations

from typing import Iterable

import numpy

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.workload.requests import Record

STALL_FACTOR = 4.0
STALL_FLOOR_S = 2.0


def percentile(values: list[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100), linearly interpolated; 0.0 for no values."""
    return float(numpy.percentile(values, q)) if values else 0.0


def summary(records: Iterable[Record]) -> dict[str, float]:
    """Return requests, p50, p95 and p99 latency (s) of the answered records."""
    latencies = [r.latency_s for r in records if r.ok]
    return {"requests": len(latencies), "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "p99_s": percentile(latencies, 99)}


def fit(pairs: list[Record]) -> tuple[float, float]:
    """Return ``(intercept_s, slope)`` of cluster latency against reference latency (Theil-Sen:
    the median of the pairwise slopes, then the median intercept; a stalled request moves neither)."""
    xs = [r.reference_latency_s or 0.0 for r in pairs]
    ys = [r.latency_s for r in pairs]
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(pairs)) for j in range(i + 1, len(pairs))
              if abs(xs[j] - xs[i]) > 1e-3]
    slope = max(0.0, percentile(slopes, 50)) if slopes else 0.0
    return percentile([y - slope * x for x, y in zip(xs, ys)], 50), slope


def check(records: Iterable[Record], budget: float, *, stall_factor: float = STALL_FACTOR,
          stall_floor_s: float = STALL_FLOOR_S) -> Verdict:
    """Fail when the median cluster/reference ratio exceeds ``budget``, or one request stalled."""
    verdict = Verdict("latency")
    records = list(records)
    pairs = [r for r in records if r.ok and r.reference_latency_s]
    verdict.figures.update(summary(records))
    if not pairs:
        verdict.fail(f"no answered request with a reference answer beside it ({len(records)} records): "
                     f"nothing to measure")
        return verdict
    ratios = [r.latency_s / r.reference_latency_s for r in pairs]
    median = percentile(ratios, 50)
    intercept, slope = fit(pairs)
    verdict.figures.update({"pairs": len(pairs), "ratio_p50": median, "ratio_p95": percentile(ratios, 95),
                            "ratio_max": max(ratios), "budget": budget, "fit_intercept_s": intercept,
                            "fit_slope": slope})
    if median > budget:
        verdict.fail(f"the cluster answers {median:.1f}x slower than the reference beside it "
                     f"(median of {len(pairs)} pairs) > budget {budget:g}x")
    for record in pairs:
        expected = max(1e-3, intercept + slope * (record.reference_latency_s or 0.0))
        if record.latency_s > stall_factor * expected and record.latency_s - expected > stall_floor_s:
            verdict.fail(f"{record.key} stalled: {record.latency_s:.2f} s where the run predicts "
                         f"{expected:.2f} s ({intercept:.2f} s + {slope:.2f} x the reference's "
                         f"{record.reference_latency_s:.3f} s; > {stall_factor:g}x and +{stall_floor_s:g} s)")
    return verdict
