"""The check's answer: one table in the terminal, and ``check.json``, ``check.md`` (a pull-request
comment: what changed, what it cost, how to reproduce one row) and ``junit.xml`` in its report folder."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_zerocopy_testbed.check.compare import BROKE, FIXED, RED, STILL_FAILING, Row
from vllm_zerocopy_testbed.check.side import MODE_ENVS, SideRun
from vllm_zerocopy_testbed.check.speed import FASTER, FIX_COST, SLOWER, THRESHOLD, SpeedRun

MiB = 1 << 20


@dataclass
class CheckResult:
    """Everything one ``make check`` found: data first, the tables are drawn from it."""

    run: str
    candidate: dict
    base: dict
    base_why: str
    command: str
    notes: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    sides: dict[str, SideRun] = field(default_factory=dict)  # "base", "candidate", "e2e-base", "e2e-candidate"
    speed: SpeedRun | None = None
    errors: list[str] = field(default_factory=list)  # the testbed's own errors, and hangs of a whole side
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds
    seconds: float = 0.0

    @property
    def red_reasons(self) -> list[str]:
        reasons = [f"{r.verdict} {r.property} ({r.path}): {r.why}" for r in self.rows if r.verdict in RED]
        if self.speed is not None:
            reasons += [f"{SLOWER} {c.path} {c.size}: x{c.ratio.median:.2f}" for c in self.speed.cells
                        if c.verdict == SLOWER]
        return reasons + self.errors

    @property
    def red(self) -> bool:
        return bool(self.red_reasons)


def reproduce(result: CheckResult, row: Row, side: str = "candidate") -> str:
    """One command that runs ``row``'s first failing (else first) test on ``side``'s code, as the check did."""
    code = (result.candidate if side == "candidate" else result.base)["make_arg"]
    test = row.failing_test or row.tests[0]
    if row.path == "e2e":
        name = test.rpartition("::")[2].partition("[")[0]
        return (f"make test-smoke VLLM={shlex.quote(code)} EXECUTOR=v2 MODES=upstream "
                f"PYTEST_ARGS={shlex.quote('-k ' + name)}")
    modes = " ".join(f"{name}=upstream" for name in MODE_ENVS)
    # make puts PYTEST_ARGS into a shell line: the node id's brackets stay quoted there
    args = f"'{test}'"
    return f'{modes} make test-core VLLM={shlex.quote(code)} PYTEST_ARGS="{args}"'


def headline(result: CheckResult) -> str:
    counts: dict[str, int] = {}
    for r in result.rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    speed = result.speed.cells if result.speed else []
    slower = sum(1 for c in speed if c.verdict == SLOWER)
    faster = sum(1 for c in speed if c.verdict == FASTER)
    cost = sum(1 for c in speed if c.verdict == FIX_COST)
    parts = [f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: (kv[0] not in RED, kv[0]))]
    if speed:
        parts.append(f"speed: {slower} slower, {cost} the fix's cost, {faster} faster, "
                     f"{len(speed) - slower - faster - cost} same")
    state = "RED" if result.red else "GREEN"
    return f"{state}: " + ", ".join(parts) + (f"; {len(result.errors)} testbed error(s)" if result.errors else "")


def _table(headers: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in line) + " |" for line in lines]
    return out


def verdict_table(result: CheckResult, width: int = 110) -> list[str]:
    """Every property and path, then every speed cell (base and candidate ms per message, the ratio)."""
    lines = []
    for r in result.rows:
        why = r.why if len(r.why) <= width else r.why[:width - 3] + "..."
        lines.append([r.path, r.property, str(len(r.tests)), r.base, r.candidate, r.verdict, why])
    for c in result.speed.cells if result.speed else []:
        noise = f", A/A {c.noise.low:.2f}-{c.noise.high:.2f}" if c.noise else ""
        verdict = {SLOWER: SLOWER, FASTER: "SAME (faster)", FIX_COST: "COST (of the FIXED row)"}.get(c.verdict, "SAME")
        lines.append([c.path, f"speed {c.size}", str(c.rounds), f"{c.base_ms:.3f} ms", f"{c.candidate_ms:.3f} ms",
                      verdict, f"candidate/base x{c.ratio.median:.2f} [{c.ratio.low:.2f}-{c.ratio.high:.2f}]{noise}"])
    return _table(["path", "property", "tests", "base", "candidate", "verdict", "why"], lines)


def speed_table(speed: SpeedRun) -> list[str]:
    lines = []
    for c in speed.cells:
        noise = f"{c.noise.low:.2f}-{c.noise.high:.2f}" if c.noise else "-"
        lines.append([c.path, c.size, f"{c.base_ms:.3f}", f"{c.candidate_ms:.3f}",
                      f"{c.ratio.median:.2f} [{c.ratio.low:.2f}-{c.ratio.high:.2f}]", noise,
                      "-" if c.shape else f"{c.base_enqueue_ms:.3f} / {c.candidate_enqueue_ms:.3f}", str(c.rounds),
                      c.verdict])
    return _table(["path", "size", "base ms/msg", "candidate ms/msg", "candidate/base [95%]", "A/A noise [95%]",
                   "enqueue ms base / cand", "rounds", "verdict"], lines)


def memory_table(result: CheckResult) -> list[str]:
    lines = []
    for label in ("base", "candidate"):
        run = result.sides.get(label)
        if run is None:
            continue
        bench = result.speed.peak_rss_bytes.get(label, 0) if result.speed else 0
        left = f"{len(run.shm.left)} files, {run.shm.left_bytes / MiB:.1f} MiB" if run.shm.left else "none"
        lines.append([label, f"{run.peak_rss_bytes / MiB:.0f}", f"{run.shm.peak_bytes / MiB:.1f}", left,
                      f"{bench / MiB:.0f}" if bench else "-"])
    return _table(["side", "suites: peak RSS MiB (largest process)", "/dev/shm peak MiB", "/dev/shm left after",
                   "bench writer: peak RSS MiB"], lines)


def slowest(result: CheckResult, n: int = 5) -> list[str]:
    steps = sorted(result.steps.items(), key=lambda kv: -kv[1])
    tests = sorted(((t.seconds, label, t.nodeid) for label, run in result.sides.items() for t in run.outcomes),
                   reverse=True)[:n]
    out = ["slowest steps: " + ", ".join(f"{name} {s:.0f} s" for name, s in steps[:n])]
    if tests:
        out.append("slowest tests: " + ", ".join(f"{nodeid.rpartition('::')[2]} ({label}) {s:.0f} s"
                                                 for s, label, nodeid in tests))
    return out


def terminal(result: CheckResult) -> str:
    out = [f"make check: {headline(result)}",
           f"candidate: {result.candidate['describe']}",
           f"base:      {result.base['describe']}",
           f"           taken because: {result.base_why}"]
    out += [f"note: {n}" for n in result.notes]
    out.append("")
    out += verdict_table(result)
    for r in result.rows:
        if r.verdict in RED and r.evidence:
            out += ["", f"{r.verdict} {r.property} ({r.path}): {r.failing_test}", *("    " + l for l in r.evidence.splitlines())]
    if result.speed is not None:
        out += ["", f"speed (candidate / base, interleaved; BROKE beyond x{1 + THRESHOLD:.2f} with the interval above 1 "
                    "and beyond the A/A noise; on a path the candidate FIXED, the fix's cost):"]
        out += speed_table(result.speed)
        out += [f"speed: {s}" for s in result.speed.skipped]
        if result.speed.error:
            out.append(f"speed: {result.speed.error}")
    out += ["", "memory:"] + memory_table(result)
    if result.errors:
        out += ["", *(f"error: {e}" for e in result.errors)]
    out += ["", *slowest(result), f"total {result.seconds:.0f} s"]
    return "\n".join(out)


def markdown(result: CheckResult) -> str:
    out = [f"### `make check`: {headline(result)}", "",
           f"- candidate: {result.candidate['describe']}",
           f"- base: {result.base['describe']}, taken because: {result.base_why}"]
    out += [f"- note: {n}" for n in result.notes]
    out += ["", "**What changed** (`vllm/` Python files that differ from the base):"]
    if result.changed:
        shown = result.changed[:15]
        out += ["", *(f"- `{p}`" for p in shown)]
        if len(result.changed) > len(shown):
            out.append(f"- and {len(result.changed) - len(shown)} more")
    else:
        out.append("none")
    out += ["", "**Verdicts** (every mode `upstream`: the code as it is, nothing of the testbed's in its place):", ""]
    out += verdict_table(result, width=400)
    fixed = [r for r in result.rows if r.verdict == FIXED]
    if fixed:
        out += ["", "Fixed: " + "; ".join(f"`{r.property}` ({r.path}): {r.why}" for r in fixed)]
    broke = [r for r in result.rows if r.verdict in RED]
    for r in broke:
        out += ["", f"**{r.verdict} `{r.property}` ({r.path})**: `{r.failing_test}`", "", "```",
                r.evidence or r.why, "```", "Reproduce (candidate, then base):", "```",
                reproduce(result, r), reproduce(result, r, "base"), "```"]
    if result.speed is not None:
        out += ["", "**What it cost** (one run, base and candidate taking turns round by round; ms per message from "
                    "enqueue until the reader rebuilt it; candidate / base with its 95% interval beside the base "
                    "against itself, the machine's noise):", ""]
        out += speed_table(result.speed)
        out += [f"- {s}" for s in result.speed.skipped] + ([f"- {result.speed.error}"] if result.speed.error else [])
    out += ["", "**Memory**", ""] + memory_table(result)
    row = next((r for r in result.rows if r.verdict in (BROKE, FIXED, STILL_FAILING)), result.rows[0] if result.rows else None)
    out += ["", "**Reproduce**", "", "```", result.command]
    if row is not None:
        out.append(f"# one row ({row.property}, {row.path}):")
        out.append(reproduce(result, row))
    out += ["```"]
    if result.errors:
        out += ["", *(f"- error: {e}" for e in result.errors)]
    out += ["", *slowest(result)]
    return "\n".join(out) + "\n"


def junit(result: CheckResult) -> ET.ElementTree:
    """One testcase per row and per speed cell; red ones fail with their reason; testbed errors as errors."""
    suite = ET.Element("testsuite", name="make check")
    failures = errors = 0
    for r in result.rows:
        case = ET.SubElement(suite, "testcase", classname=f"check.{r.path}", name=r.property)
        props = ET.SubElement(case, "properties")
        for name, value in (("verdict", r.verdict), ("base", r.base), ("candidate", r.candidate), ("why", r.why)):
            ET.SubElement(props, "property", name=name, value=value)
        if r.verdict in RED:
            failures += 1
            ET.SubElement(case, "failure", message=f"{r.verdict}: {r.why}"[:500]).text = r.evidence
    for c in result.speed.cells if result.speed else []:
        case = ET.SubElement(suite, "testcase", classname=f"check.speed.{c.path.replace(' ', '_')}",
                             name=c.size.replace(" ", ""))
        if c.verdict == SLOWER:
            failures += 1
            ET.SubElement(case, "failure", message=f"candidate/base x{c.ratio.median:.2f} "
                          f"[{c.ratio.low:.2f}-{c.ratio.high:.2f}]")
    for e in result.errors:
        errors += 1
        case = ET.SubElement(suite, "testcase", classname="check.testbed", name="run")
        ET.SubElement(case, "error", message=e[:500])
    suite.set("tests", str(len(suite)))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("time", f"{result.seconds:.1f}")
    return ET.ElementTree(suite)


def write(result: CheckResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "check.json", out / "check.md", out / "junit.xml"]
    data = asdict(result)
    data["headline"], data["red"], data["red_reasons"] = headline(result), result.red, result.red_reasons
    paths[0].write_text(json.dumps(data, indent=1, default=str))
    paths[1].write_text(markdown(result))
    junit(result).write(paths[2], encoding="unicode", xml_declaration=True)
    return paths
