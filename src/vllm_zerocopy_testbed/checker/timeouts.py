"""Liveness: every request ended with an answer within its bound."""

from __future__ import annotations

from typing import Iterable

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.workload.requests import Record


def check(records: Iterable[Record]) -> Verdict:
    """Fail for every request that timed out (a hang), errored, or answered past its bound."""
    verdict = Verdict("timeouts")
    records = list(records)
    if not records:
        verdict.fail("no request was recorded")
    for record in records:
        if record.status == "timeout":
            verdict.fail(f"{record.key}: HANG, no answer within its bound of {record.bound_s:.0f} s")
        elif record.status == "error":
            status = f"HTTP {record.http_status}" if record.http_status else "no HTTP answer"
            verdict.fail(f"{record.key}: {status} after {record.latency_s:.1f} s: {record.error}")
        elif record.latency_s > record.bound_s:
            verdict.fail(f"{record.key}: answered after {record.latency_s:.1f} s, bound {record.bound_s:.0f} s")
    verdict.figures["requests"] = len(records)
    verdict.figures["max_latency_s"] = max((r.latency_s for r in records), default=0.0)
    return verdict
