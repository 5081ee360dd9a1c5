"""Latency: percentiles per workload against a budget relative to the single-process reference.

The budget is a ratio measured in the same run, never an absolute time: the
cluster's p95 must stay within ``factor`` times the reference's p50 for the same
requests (PP=2 x TP=2 over Ray on one core per node pays for two stages, a
network hop and all-reduces that a single process does not).
"""

from __future__ import annotations

from typing import Iterable

import numpy

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.workload.requests import Record


def percentile(values: list[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100), linearly interpolated; 0.0 for no values."""
    return float(numpy.percentile(values, q)) if values else 0.0


def summary(records: Iterable[Record]) -> dict[str, float]:
    """Return requests, p50, p95 and p99 latency (s) of the answered records."""
    latencies = [r.latency_s for r in records if r.ok]
    return {"requests": len(latencies), "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "p99_s": percentile(latencies, 99)}


def check(records: Iterable[Record], reference: Iterable[Record], factor: float) -> Verdict:
    """Fail when the records' p95 exceeds ``factor`` x the reference's p50."""
    verdict = Verdict("latency")
    ours, theirs = summary(records), summary(reference)
    budget = factor * theirs["p50_s"]
    verdict.figures.update({**ours, "reference_p50_s": theirs["p50_s"], "budget_s": budget,
                            "ratio_p95": ours["p95_s"] / theirs["p50_s"] if theirs["p50_s"] else 0.0})
    if not ours["requests"] or not theirs["requests"]:
        verdict.fail("no answered requests to measure")
    elif ours["p95_s"] > budget:
        verdict.fail(f"p95 {ours['p95_s']:.3f} s > budget {budget:.3f} s "
                     f"({factor:g} x reference p50 {theirs['p50_s']:.3f} s)")
    return verdict
