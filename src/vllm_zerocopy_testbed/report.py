"""The run report: results as JSON first, then a Markdown file and a terminal table drawn from it.

One row per suite, one column per profile (executor/modes); a cell says the
worst outcome of the suite's tests there, how many requests it sent, and their
p50/p95 latency. Known failures follow, one line per finding and profile with the
tests it covers: a finding fails every test that reaches its path.

``python -m vllm_zerocopy_testbed.report recheck reports/<run>`` judges a finished run again from
the evidence it saved (``checker/evidence.py``): exit 0 when every verdict is the same, 1 when one
differs (or its inputs could not be saved), 2 when there is nothing to judge.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from vllm_zerocopy_testbed.checker import Verdict, evidence
from vllm_zerocopy_testbed.vllm_source import running, vllm_line
from vllm_zerocopy_testbed.checker.latency import summary
from vllm_zerocopy_testbed.known import finding_of
from vllm_zerocopy_testbed.workload.requests import Event, Record

# Worst first: a suite's cell shows the worst outcome among its tests.
_SEVERITY = ("failed", "error", "xpassed", "xfailed", "passed", "skipped")
_LABEL = {"failed": "FAIL", "error": "ERROR", "xpassed": "XPASS(!)", "xfailed": "known-fail", "passed": "pass",
          "skipped": "skip"}


@dataclass
class TestResult:
    """One test's outcome, with the suite and profile it belongs to."""

    __test__ = False

    test: str
    suite: str
    profile: str
    outcome: str
    duration_s: float = 0.0
    message: str = ""


@dataclass
class RunReport:
    """Everything a run produced; ``write`` turns it into files."""

    started: float = field(default_factory=time.time)
    profiles: list[str] = field(default_factory=list)
    results: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    vllm: dict[str, Any] = field(default_factory=running)  # which vLLM code ran (VLLM=: an overlay)

    def cells(self, records: Iterable[Record]) -> dict[tuple[str, str], dict[str, Any]]:
        """Return (suite, profile) -> outcome, tests, requests, answered, p50_s, p95_s (of the answered)."""
        records = list(records)
        cells: dict[tuple[str, str], dict[str, Any]] = {}
        for result in self.results:
            cell = cells.setdefault((result.suite, result.profile), {"outcome": "skipped", "tests": 0})
            cell["tests"] += 1
            if _SEVERITY.index(result.outcome) < _SEVERITY.index(cell["outcome"]):
                cell["outcome"] = result.outcome
        for (suite, profile), cell in cells.items():
            mine = [r for r in records if r.suite == suite and r.profile == profile]
            answered = summary(mine)
            cell.update(answered, answered=answered["requests"], requests=len(mine))
        return cells

    def known_failures(self) -> list[dict[str, Any]]:
        """Return one entry per known failure and profile, profiles in run order: ``profile``,
        ``finding`` (the folder under ``findings/`` its reason names, or None), ``reason`` (the
        first test's reason line) and ``tests`` (their names, without the profile's parameter id).

        Grouped by finding where the reason names one (the reasons of one finding's tests may
        differ in their figures), else by the reason itself."""
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        for result in self.results:
            if result.outcome != "xfailed":
                continue
            reason = result.message.splitlines()[0] if result.message else ""
            finding = finding_of(reason)
            entry = groups.setdefault((result.profile, finding or reason),
                                      {"profile": result.profile, "finding": finding, "reason": reason, "tests": []})
            entry["tests"].append(_without_profile(result.test, result.profile))
        order = {p: i for i, p in enumerate(self.profiles)}
        return sorted(groups.values(), key=lambda e: order.get(e["profile"], len(order)))

    def table(self, records: Iterable[Record]) -> str:
        """Return the suite x profile table as Markdown (also readable in a terminal)."""
        cells = self.cells(records)
        suites = sorted({s for s, _ in cells}, key=lambda s: (s == "across", s))
        profiles = [p for p in self.profiles if any(p == q for _, q in cells)] + \
            sorted({p for _, p in cells} - set(self.profiles))
        lines = ["| suite | " + " | ".join(profiles) + " |", "|---" * (len(profiles) + 1) + "|"]
        for suite in suites:
            row = [suite]
            for profile in profiles:
                cell = cells.get((suite, profile))
                if cell is None:
                    row.append("-")
                    continue
                text = _LABEL[cell["outcome"]]
                if cell["requests"]:
                    text += f" {cell['requests']} req"
                if cell["answered"] < cell["requests"]:
                    text += f" ({cell['requests'] - cell['answered']} failed)"
                if cell["answered"]:
                    text += f" p50 {cell['p50_s']:.2f} s p95 {cell['p95_s']:.2f} s"
                row.append(text)
            lines.append("| " + " | ".join(row) + " |")
        return "\n".join(lines)

    def write(self, run_dir: Path, records: Iterable[Record], events: Iterable[Event] = ()) -> list[Path]:
        """Write ``results.json`` (``history``: the records; ``events``: what nemeses did) and
        ``report.md`` under ``run_dir``; return their paths."""
        records = list(records)
        run_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "started": self.started, "profiles": self.profiles, "notes": self.notes, "vllm": self.vllm,
            "results": [asdict(r) for r in self.results],
            "cells": [{"suite": s, "profile": p, **c} for (s, p), c in self.cells(records).items()],
            "known": self.known_failures(),
            "history": [r.to_json() for r in records],
            "events": [e.to_json() for e in events],
        }
        results_json = run_dir / "results.json"
        results_json.write_text(json.dumps(data, indent=1))
        failed = [r for r in self.results if r.outcome in ("failed", "error", "xpassed")]
        skipped = [r for r in self.results if r.outcome == "skipped"]
        md = [f"# e2e run {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.started))} UTC", "",
              f"vLLM under test: {vllm_line(self.vllm)}", "",
              "Cells: worst outcome of the suite's tests, requests sent, latency p50/p95 "
              "(known-fail = a strict expected failure that did fail).", "", self.table(records), ""]
        if failed:
            md += ["## Failures", "", *(_test_line(r) for r in failed), ""]
        known = data["known"]
        if known:
            md += ["## Known failures (expected, strict): one line per finding and profile", ""]
            md += [_known_line(k) for k in known]
            md.append("")
        if skipped:
            md += ["## Skipped, and why", "", *(_test_line(r) for r in skipped), ""]
        if self.notes:
            md += ["## Notes", "", *(f"- {n}" for n in self.notes), ""]
        md += ["Raw data: `results.json` (every request: timings, tokens, logprobs); `junit.xml`.", ""]
        report_md = run_dir / "report.md"
        report_md.write_text("\n".join(md))
        return [results_json, report_md]


def _test_line(result: TestResult) -> str:
    return f"- `{result.test}` ({result.profile}): {result.message.splitlines()[0] if result.message else ''}"


def _known_line(known: dict[str, Any]) -> str:
    tests = ", ".join(f"`{test}`" for test in known["tests"])
    return f"- {known['profile']}: {known['reason']}; tests: {tests}"


def _without_profile(test: str, profile: str) -> str:
    """``test_x[v2/upstream]`` -> ``test_x``; ``test_y[v2/upstream-case]`` -> ``test_y[case]``."""
    for old, new in ((f"[{profile}]", ""), (f"[{profile}-", "["), (f"-{profile}]", "]"), (f"-{profile}-", "-")):
        if old in test:
            return test.replace(old, new, 1)
    return test


def faults_table(rows: list[dict[str, Any]]) -> str:
    """Return the nemesis table: profile, bound, time to first error, last end, /health, recovery,
    bit-exact; each row's note (what the nemesis saw beside its figures) below it."""
    lines = ["| nemesis | profile | bound | requests (failed) | first error | last request ended | /health not 200 | "
             "recovered | bit-exact after |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        first = f"{r['first_error_s']:.1f} s" if r["first_error_s"] >= 0 else "none"
        health = f"{r['unhealthy_after_s']:.1f} s" if r["unhealthy_after_s"] is not None else "stayed 200"
        verdict = "" if r["within_bound"] else " **over bound**"
        lines.append(f"| {r['nemesis']} | {r.get('profile') or '-'} | {r['bound_s']:.0f} s | {r['requests']} "
                     f"({r['failed']}) | {first} | {r['last_end_s']:.1f} s{verdict} | {health} | {r['recovered']} in "
                     f"{r['recovery_s']:.0f} s | {'yes' if r['bit_exact_after'] else 'NO'} |")
        if r.get("note"):
            notes.append(f"- {r['nemesis']} ({r.get('profile') or '-'}): {r['note']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def fault_row(nemesis: str, what: str, backend: str, bound: Verdict, records: Iterable[Record], fault_at: float,
              unhealthy_after_s: float | None, recovered: str, recovery_s: float, bit_exact_after: bool,
              *, profile: str = "", note: str = "") -> dict[str, Any]:
    """One row of ``faults.json``: what the nemesis did and how the cluster took it (seconds after the fault)."""
    errors = sorted({(r.error or "")[:120] for r in records if not r.ok and r.started + r.latency_s >= fault_at})
    figures = bound.figures
    return {
        "nemesis": nemesis, "what": what, "backend": backend, "profile": profile, "bound_s": figures.get("bound_s", 0.0),
        "requests": int(figures.get("requests", 0)), "failed": int(figures.get("failed", 0)),
        "first_error_s": round(figures.get("first_error_s", -1.0), 1),
        "last_end_s": round(figures.get("last_end_s", 0.0), 1), "within_bound": bound.ok,
        "unhealthy_after_s": round(unhealthy_after_s, 1) if unhealthy_after_s is not None else None,
        "recovered": recovered, "recovery_s": round(recovery_s, 1), "bit_exact_after": bit_exact_after,
        "errors": errors[:3], "note": note,
    }


def write_faults(run_dir: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Write ``faults.json`` and ``faults.md`` into ``run_dir``; return their paths."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data, text = run_dir / "faults.json", run_dir / "faults.md"
    data.write_text(json.dumps(rows, indent=2))
    text.write_text(f"# Nemeses (make faults)\n\nvLLM under test: {vllm_line(running())}\n\n"
                    "Times are seconds after the fault.\n\n" + faults_table(rows) + "\n")
    return [data, text]


def recheck(run_dir: Path) -> int:
    """Print one line per test of a run judged again from its evidence, and a summary; return the exit
    status: 0 every verdict the same, 1 one differs or was not saved, 2 nothing to judge (one line on
    stderr why)."""
    try:
        results = evidence.recheck(run_dir)
    except (evidence.EvidenceError, evidence.UnknownChecker) as exc:
        print(f"recheck: {exc}", file=sys.stderr)
        return 2
    for line in evidence.lines(results):
        print(line)
    return 0 if all(t.same for t in results) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_zerocopy_testbed.report recheck reports/<run>``: the run's verdicts judged again."""
    parser = argparse.ArgumentParser(prog="python -m vllm_zerocopy_testbed.report",
                                     description="the e2e run report's offline commands")
    commands = parser.add_subparsers(dest="command", required=True)
    again = commands.add_parser("recheck", help="judge a finished run again from the evidence it saved")
    again.add_argument("run", type=Path, help="the run's report folder, reports/<run>")
    args = parser.parse_args(argv)
    return recheck(args.run)


if __name__ == "__main__":
    raise SystemExit(main())
