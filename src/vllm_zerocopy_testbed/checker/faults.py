"""Fault bounds: every request that overlapped a fault, or came after it, ended within the bound."""

from __future__ import annotations

from typing import Iterable

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.workload.requests import Event, Record


def ended_at(record: Record) -> float:
    return record.started + record.latency_s


def fault_time(events: Iterable[Event]) -> float | None:
    """The fault's time: the first ``apply`` event's (the nemesis schedule records it)."""
    applied = [e.at for e in events if e.phase == "apply"]
    return min(applied) if applied else None


def check(records: Iterable[Record], events: Iterable[Event], bound_s: float) -> Verdict:
    """Fail for each request that was in flight at the fault (its time read from ``events``) or
    started later and did not end (answer or error) within ``bound_s`` of the later of the two;
    figures: time to first error and to the last end, seconds after the fault."""
    verdict = Verdict("fault-bound", figures={"bound_s": bound_s})
    events = list(events)
    fault_at = fault_time(events)
    if fault_at is None:
        verdict.fail("no fault was applied (no apply event in the history): nothing to judge")
        return verdict
    failed = [e for e in events if e.phase == "failed"]
    for event in failed:
        verdict.fail(f"the nemesis {event.kind} failed on {event.target}: {event.detail}")
    affected = [r for r in records if ended_at(r) >= fault_at]
    if not affected:
        verdict.fail("no request was in flight at the fault or sent after it: the workload did not cover it")
        return verdict
    for record in affected:
        waited = ended_at(record) - max(record.started, fault_at)
        if record.status == "timeout" or waited > bound_s:
            verdict.fail(f"{record.key}: ended {waited:.1f} s after the fault ({record.status}), bound {bound_s:.0f} s")
    errors = [ended_at(r) - fault_at for r in affected if not r.ok]
    verdict.figures["requests"] = len(affected)
    verdict.figures["failed"] = len(errors)
    verdict.figures["first_error_s"] = min(errors) if errors else -1.0
    verdict.figures["last_end_s"] = max(ended_at(r) for r in affected) - fault_at
    return verdict
