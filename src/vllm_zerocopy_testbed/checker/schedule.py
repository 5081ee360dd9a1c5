"""A fault schedule's run judged from what it recorded: bounded answers, errors only while a
fault is in force, a recovery after each fault, nothing left behind.

The inputs are data (the schedule's step records, the stream's request records, the node states
after the run), so a stored run (``schedule-run.json``) is re-judged offline with the same calls.
A fault's window runs from its apply to its heal (an instant operation's: to the end of its
step); it stays *in force* for errors until the first good answer after the heal (its recovery).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from vllm_zerocopy_testbed.checker import Verdict, bitexact
from vllm_zerocopy_testbed.checker.faults import ended_at
from vllm_zerocopy_testbed.workload.requests import Record


@dataclass(frozen=True)
class Window:
    """One fault as it ran: epoch seconds of its apply and heal, and whether either step failed."""

    index: int
    kind: str
    node: str
    start: float
    healed: float
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.index:02d}-{self.kind} {self.node}"


def windows(steps: Iterable[Any]) -> list[Window]:
    """One window per applied operation from its step records (``schedule.StepRecord`` or their
    JSON): from the apply's start to the heal's end, or to the apply's end where it has no heal."""
    by_op: dict[int, dict[str, Any]] = {}
    for step in steps:
        data = step if isinstance(step, Mapping) else step.to_json()
        by_op.setdefault(int(data["index"]), {})[data["phase"]] = data
    found = []
    for index, phases in sorted(by_op.items()):
        apply = phases.get("apply")
        if apply is None:
            continue
        heal = phases.get("heal")
        errors = [f"{phase}: {p['error']}" for phase, p in phases.items() if p.get("error")]
        found.append(Window(index, apply["kind"], apply["node"], float(apply["started"]),
                            float((heal or apply)["ended"]), "; ".join(errors) or None))
    return found


def recoveries(records: Iterable[Record], faults: list[Window]) -> dict[int, float | None]:
    """Seconds from each fault's heal to the end of the first good answer sent after it (None: none)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.started)
    found: dict[int, float | None] = {}
    for window in faults:
        first = next((r for r in ok if r.started >= window.healed), None)
        found[window.index] = None if first is None else ended_at(first) - window.healed
    return found


def check_bound(records: Iterable[Record], faults: list[Window], bound_s: float) -> Verdict:
    """Fail for every hang (a request that got neither answer nor error within its own bound) and
    every request that ended more than ``bound_s`` after the later of its start and the last
    fault applied while it ran."""
    verdict = Verdict("schedule-bound", figures={"bound_s": bound_s})
    records = list(records)
    if not records:
        verdict.fail("no request was recorded: the workload did not run beside the schedule")
    for record in records:
        end = ended_at(record)
        applied = [w.start for w in faults if record.started <= w.start <= end]
        waited = end - max([record.started, *applied])
        if record.status == "timeout":
            verdict.fail(f"{record.key} sent at {record.started:.1f}: HANG, no answer nor error within "
                         f"{record.bound_s:.0f} s")
        elif waited > bound_s:
            verdict.fail(f"{record.key} sent at {record.started:.1f}: ended {waited:.1f} s after "
                         f"{'the fault' if applied else 'it was sent'} ({record.status}), bound {bound_s:.0f} s")
    verdict.figures["requests"] = len(records)
    verdict.figures["failed"] = sum(not r.ok for r in records)
    return verdict


def check_errors(records: Iterable[Record], faults: list[Window], run_end: float) -> Verdict:
    """Fail for every request that failed while no fault was in force: outside every window from
    a fault's apply to its recovery (the first good answer after its heal, or the run's end)."""
    verdict = Verdict("errors-in-faults")
    records = list(records)
    recovered = recoveries(records, faults)
    spans = [(w.start, w.healed + recovered[w.index] if recovered[w.index] is not None else run_end)
             for w in faults]
    for record in records:
        if record.ok:
            continue
        start, end = record.started, ended_at(record)
        if not any(start <= until and end >= since for since, until in spans):
            verdict.fail(f"{record.key} sent at {start:.1f}: failed with no fault in force: {(record.error or '')[:160]}")
    verdict.figures["failed"] = sum(not r.ok for r in records)
    return verdict


def check_recovery(records: Iterable[Record], faults: list[Window], recovery_s: float, run_end: float) -> Verdict:
    """Fail for every fault after which the cluster gave no good answer within ``recovery_s`` of its
    heal although no other fault was in force and none began meanwhile; a recovery that the next
    fault cut short is unknown, not a failure. Figures: each fault's recovery (-1: unknown)."""
    verdict = Verdict("recovery", figures={"recovery_bound_s": recovery_s})
    recovered = recoveries(records, faults)
    measured = []
    for window in faults:
        seconds = recovered[window.index]
        overlapped = any(o.start <= window.healed < o.healed for o in faults if o is not window)
        quiet_until = min([o.start for o in faults if o.start > window.healed] + [run_end])
        judged = not overlapped and quiet_until - window.healed >= recovery_s
        if seconds is not None:
            measured.append(seconds)
        verdict.figures[f"{window.index:02d}-{window.kind}_s"] = round(seconds, 1) if seconds is not None else -1.0
        if judged and (seconds is None or seconds > recovery_s):
            got = "no good answer after it" if seconds is None else f"the first good answer {seconds:.0f} s after it"
            verdict.fail(f"{window.label}: not recovered within {recovery_s:.0f} s of its heal ({got})")
    verdict.figures["faults"] = len(faults)
    verdict.figures["recovered"] = len(measured)
    verdict.figures["max_recovery_s"] = round(max(measured), 1) if measured else -1.0
    return verdict


def check_left_behind(states: Mapping[str, str], leftovers: Iterable[str] = ()) -> Verdict:
    """Fail for a node not running when the run ends (left paused, isolated, exited) and for
    anything ``Cluster.leftovers()`` names after ``down``."""
    verdict = Verdict("nothing-left-behind")
    for node, state in sorted(states.items()):
        if state != "running":
            verdict.fail(f"{node} is {state} after the schedule and its recovery")
    for thing in leftovers:
        verdict.fail(f"left behind: {thing}")
    return verdict


def check_steps(faults: list[Window], scheduled: int) -> Verdict:
    """Fail for a heal that failed (the fault may still be in place) and an operation never applied.
    An apply that failed is counted, not failed: in Jepsen's terms its outcome is unknown (the node
    may already have been down from an earlier fault); the stored run keeps its error."""
    verdict = Verdict("schedule-ran", figures={"scheduled": scheduled, "applied": len(faults)})
    for window in faults:
        if window.error and "heal: " in window.error:
            verdict.fail(f"{window.label}: {window.error}")
    if len(faults) < scheduled:
        verdict.fail(f"{scheduled - len(faults)} of {scheduled} operation(s) never applied")
    verdict.figures["failed_steps"] = sum(1 for w in faults if w.error)
    verdict.figures["failed_applies"] = sum(1 for w in faults if w.error and "apply: " in w.error)
    return verdict


# -- a stored run ----------------------------------------------------------------------------------
RUN_FILE = "schedule-run.json"


def check_run(data: Mapping[str, Any]) -> list[Verdict]:
    """Every verdict on one stored schedule run (``schedule-run.json``'s content): the steps ran,
    the bound, errors only in faults, recoveries, nothing left behind, the answers given during
    the schedule (tokens) and after recovery (bit-exact) against the answers before it."""
    records = [Record(**r) for r in data["records"]]
    before, after = ([Record(**r) for r in data[part]] for part in ("before", "after"))
    faults = windows(data["steps"])
    expected = bitexact.first_answers(before)
    return [
        check_steps(faults, len(data["schedule"]["ops"])),
        check_bound(records, faults, float(data["bound_s"])),
        check_errors(records, faults, float(data["ends_at"])),
        check_recovery(records, faults, float(data["recovery_bound_s"]), float(data["ends_at"])),
        check_left_behind(data["states"], data.get("leftovers", [])),
        bitexact.check([r for r in records if r.ok], expected, tokens_only=True, name="answers during the schedule"),
        bitexact.check(after, expected, name="bit-exact after recovery"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Re-judge a stored run offline: ``python -m vllm_zerocopy_testbed.checker.schedule reports/<run>``."""
    parser = argparse.ArgumentParser(prog="python -m vllm_zerocopy_testbed.checker.schedule",
                                     description=f"judge a stored fault schedule run ({RUN_FILE})")
    parser.add_argument("run", type=Path, help=f"a run's report folder or its {RUN_FILE}")
    path = parser.parse_args(argv).run
    path = path / RUN_FILE if path.is_dir() else path
    verdicts = check_run(json.loads(path.read_text()))
    for verdict in verdicts:
        print(verdict)
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
