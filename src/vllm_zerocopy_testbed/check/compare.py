"""Verdicts: per test, then per property and path, from the two sides' outcomes (pure functions).

A known failure is recognised by its ``known.py`` signature (the words of its failing check), so
that a candidate that still fails, but differently, is BROKE and not STILL-FAILING.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_zerocopy_testbed.known import COMPONENT

PASSED, FAILED, HANG, SKIPPED, NOT_RUN = "passed", "failed", "hang", "skipped", "not run"

FIXED, BROKE, STILL_FAILING, SAME = "FIXED", "BROKE", "STILL-FAILING", "SAME"
# Where one side lacks the path (a release before it, or after its removal): reported, never red.
NEW, GONE = "NEW", "GONE"
# The candidate hung where the base hung too; a side that ran past its bound left tests unrun.
HANG_VERDICT, NOT_RUN_VERDICT = "HANG", "NOT-RUN"
RED = (BROKE, HANG_VERDICT, NOT_RUN_VERDICT)
# A row's verdict is its worst test's (a row with one test broken is broken).
_ORDER = (BROKE, HANG_VERDICT, NOT_RUN_VERDICT, STILL_FAILING, FIXED, NEW, GONE, SAME)

# pytest-timeout's failure ("Timeout (>180.0s) from pytest-timeout."): the test hung.
_TIMEOUT = re.compile(r"Timeout \(>[\d.]+s\) from pytest-timeout")


@dataclass
class CaseOutcome:
    """One test on one side: its outcome, and for a failure its first line and evidence."""

    nodeid: str
    property: str
    path: str
    outcome: str  # passed | failed | hang | skipped
    message: str = ""  # a failure's first line, a skip's reason
    text: str = ""  # a failure's evidence (the assertion and its values), trimmed
    seconds: float = 0.0


@dataclass
class CaseVerdict:
    nodeid: str
    base: str
    candidate: str
    verdict: str
    why: str = ""
    evidence: str = ""


@dataclass
class Row:
    """One property on one path: its tests, each side's outcome and the verdict."""

    property: str
    path: str
    tests: list[str]
    base: str
    candidate: str
    verdict: str
    why: str = ""
    evidence: str = ""
    failing_test: str = ""  # BROKE: the first check that failed (reproduce it alone)
    verdicts: list[CaseVerdict] = field(default_factory=list)

    @property
    def red(self) -> bool:
        return self.verdict in RED


def is_hang(message: str, text: str = "") -> bool:
    """Whether a failure is pytest-timeout's (the test ran past its bound)."""
    return bool(_TIMEOUT.search(message) or _TIMEOUT.search(text))


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, at most 240 characters."""
    line = next((l.strip() for l in text.splitlines() if l.strip()), "")
    return line[:240]


def known_failure(prop: str, text: str) -> bool:
    """Whether ``text`` (a failure's message and evidence) is ``prop``'s known failure (``known.py``)."""
    known = COMPONENT.get(prop)
    return known is not None and re.search(known.signature.pattern, text, re.DOTALL) is not None


def finding(prop: str) -> str:
    """The known failure's reason under ``upstream`` (it names its ``findings/<folder>``), else ""."""
    known = COMPONENT.get(prop)
    return known.reasons.get("upstream", "") if known else ""


def _normalised(line: str) -> str:
    """A failure line with its numbers blanked: the same failure measured twice differs in figures."""
    return re.sub(r"\d+(\.\d+)?", "N", line)


def verdict_of(nodeid: str, prop: str, base: CaseOutcome | None, cand: CaseOutcome | None) -> CaseVerdict:
    """The verdict for one test from its two outcomes (None: the side has no record of it)."""
    b = base.outcome if base else NOT_RUN
    c = cand.outcome if cand else NOT_RUN
    evidence = cand.text if cand and cand.outcome in (FAILED, HANG) else ""
    message = cand.message if cand else ""

    def v(verdict: str, why: str = "", ev: str = "") -> CaseVerdict:
        return CaseVerdict(nodeid, b, c, verdict, why, ev)

    if c == NOT_RUN:
        return v(NOT_RUN_VERDICT, "the candidate's run ended before this test (its bound passed)")
    if b == NOT_RUN and c != SKIPPED:
        return v(NOT_RUN_VERDICT, "the base's run ended before this test (its bound passed)")
    if c == HANG:
        if b == HANG:
            return v(HANG_VERDICT, f"hangs on both: {message}", evidence)
        return v(BROKE, f"hangs: {message}", evidence)
    if c == SKIPPED:
        if b in (SKIPPED, NOT_RUN):
            return v(SAME, message)
        return v(GONE, f"the candidate skips it: {message}")
    if c == PASSED:
        if b == PASSED:
            return v(SAME)
        if b in (FAILED, HANG):
            found = finding(prop) or f"the base's failure: {base.message if base else ''}"
            return v(FIXED, f"{found}: passes now")
        return v(NEW, f"the base skips it ({base.message if base else ''}); passes on the candidate")
    # the candidate failed
    if b == PASSED:
        return v(BROKE, message, evidence)
    known = known_failure(prop, f"{cand.message}\n{cand.text}")
    if b in (FAILED, HANG):
        if known:
            return v(STILL_FAILING, finding(prop) or message)
        if base is not None and _normalised(first_line(base.message)) == _normalised(first_line(message)):
            return v(STILL_FAILING, f"fails as on the base: {message}")
        return v(BROKE, f"fails differently from the base ({first_line(base.message) if base else ''}): {message}",
                 evidence)
    # the base skips it (it lacks the path): a known failure of the new path, else broken
    if known:
        return v(STILL_FAILING, f"a path new to the candidate, with its known failure: {finding(prop) or message}")
    return v(BROKE, f"a path new to the candidate fails: {message}", evidence)


def rows(base: list[CaseOutcome], candidate: list[CaseOutcome]) -> list[Row]:
    """One row per (property, path), tests in run order; its verdict the worst of its tests'."""
    by_base = {t.nodeid: t for t in base}
    by_cand = {t.nodeid: t for t in candidate}
    order: dict[tuple[str, str], list[str]] = {}
    for t in [*candidate, *base]:
        ids = order.setdefault((t.property, t.path), [])
        if t.nodeid not in ids:
            ids.append(t.nodeid)
    result = []
    for (prop, path), ids in order.items():
        verdicts = [verdict_of(i, prop, by_base.get(i), by_cand.get(i)) for i in ids]
        worst = min(verdicts, key=lambda tv: _ORDER.index(tv.verdict))
        row = Row(prop, path, ids, _side_outcome([by_base.get(i) for i in ids]),
                  _side_outcome([by_cand.get(i) for i in ids]), worst.verdict, worst.why, worst.evidence,
                  worst.nodeid if worst.verdict in RED else "", verdicts)
        counted = [tv for tv in verdicts if tv.verdict == worst.verdict]
        if len(verdicts) > 1 and worst.verdict != SAME:
            row.why = f"{len(counted)} of {len(verdicts)} tests: {worst.why}" if worst.why else \
                f"{len(counted)} of {len(verdicts)} tests"
        fixed = [tv for tv in verdicts if tv.verdict == FIXED]
        if fixed and worst.verdict != FIXED:
            row.why += f"; {len(fixed)} of {len(verdicts)} FIXED"
        result.append(row)
    return sorted(result, key=lambda r: (_path_rank(r.path), r.property))


def _path_rank(path: str) -> int:
    from vllm_zerocopy_testbed.check.suites import PATHS

    return PATHS.index(path) if path in PATHS else len(PATHS)


def _side_outcome(outcomes: list[CaseOutcome | None]) -> str:
    """A side's outcome over a row's tests: the worst (hang, failed, not run), else passed, else skipped;
    with counts where tests differ."""
    names = [o.outcome if o else NOT_RUN for o in outcomes]
    for worst in (HANG, FAILED, NOT_RUN):
        if worst in names:
            n = names.count(worst)
            return worst if n == len(names) else f"{worst} {n}/{len(names)}"
    return PASSED if PASSED in names else SKIPPED


def red(table: list[Row]) -> list[Row]:
    """The rows that make the run red."""
    return [r for r in table if r.red]
