"""Run every finding's ``repro.py`` on the installed (stock) vLLM and with its ``fix.diff``, and judge.

A finding is a folder of ``findings/``: ``repro.py`` (standalone: vLLM, and Ray where the path
needs it; exit 1 when the bug shows, 0 when it does not, 3 when the release lacks the code path,
2 when it cannot run; its own cap on time, ``CAP_S``), ``fix.diff`` (a unified diff against the release's files, paths ``a/vllm/...``)
and ``REPORT.md``. The fix is applied with ``patch`` to scratch copies of those files and served
through the mutants' overlay (``mutants/overlay.py``): the installed vLLM is never touched, and
the overlay's load log proves the patched run imported the patched module. A repro that passes
on stock is red (the finding no longer reproduces), as is one that fails with the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.bench import stats
from vllm_zerocopy_testbed.cluster import process
from vllm_zerocopy_testbed.cluster.shm import ShmClaim
from vllm_zerocopy_testbed.config import REPO_ROOT, process_env
from vllm_zerocopy_testbed.mutants import overlay

FINDINGS = REPO_ROOT / "findings"
# The runner's bound on one repro beyond the repro's own cap (vLLM's import, reaping its children).
MARGIN_S = 60
DEFAULT_CAP_S = 240
# How often a run's processes are read (PIDs, what they map in /dev/shm) while they live: a process
# that made a Ray channel semaphore and was killed is known as ours only if a reading saw it alive.
SHM_WATCH_S = 0.5
# No plugin of this testbed (nor any other) may change what the repro runs: vLLM loads only
# the general plugins VLLM_PLUGINS names, and an empty name names none.
STOCK_ENV = {"VLLM_PLUGINS": ""}

REPRODUCES, FIXED = "reproduces", "fixed"  # the expected results, stock and patched
NOT_REPRODUCED, NOT_FIXED, ERROR, HANG = "no longer reproduces", "not fixed", "error", "runner cap"
# Exit 3: the release under test lacks the code path (VLLM=0.33.0 has no compiled-graph executor)
NOT_APPLICABLE = "not in this release"


# What a repro prints with each exit status: an exit status without its line (a traceback exits 1
# too) is an error, never a verdict. ``--bench`` prints one ``BENCH`` line of JSON instead.
_LINES = {1: ("FAIL", "HANG"), 0: ("OK",), 3: ("N/A",), 2: ("ERROR",)}
BENCH = "BENCH "
_PREFIXES = tuple(p for prefixes in _LINES.values() for p in prefixes) + (BENCH,)
# Rounds of --bench: fewer cannot show the spread (stats.spread needs 4 values).
MIN_BENCH_ROUNDS = 4


class FindingError(ValueError):
    """A finding folder is not complete or its diff cannot be applied: names the file and the fix."""


@dataclass(frozen=True)
class Finding:
    name: str
    folder: Path
    cap_s: float

    @property
    def repro(self) -> Path:
        return self.folder / "repro.py"

    @property
    def diff(self) -> Path:
        return self.folder / "fix.diff"

    @property
    def diffs(self) -> list[Path]:
        """``fix.diff`` (against the release the finding was made on), then ``fix-<release>.diff``
        for later releases whose code moved: the first that applies is the fix."""
        return [self.diff, *sorted(self.folder.glob("fix-*.diff"))]

    @property
    def has_bench(self) -> bool:
        """Whether ``repro.py --bench`` measures the fix's cost (a ``BENCH`` line of JSON)."""
        return '"--bench"' in self.repro.read_text()


def discover(root: Path = FINDINGS, only: list[str] | None = None) -> list[Finding]:
    """The findings under ``root`` (sorted), or those named in ``only``; each must be complete."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    names = [p.name for p in folders]
    unknown = [n for n in only or [] if n not in names]
    if unknown:
        raise FindingError(f"no finding named {', '.join(unknown)} under {root} (have: {', '.join(names)})")
    found = []
    for folder in folders:
        if only and folder.name not in only:
            continue
        missing = [f for f in ("repro.py", "fix.diff", "REPORT.md") if not (folder / f).is_file()]
        if missing:
            raise FindingError(f"{folder}: missing {', '.join(missing)} (a finding needs repro.py, fix.diff, REPORT.md)")
        cap = re.search(r"^CAP_S\s*=\s*(\d+)", (folder / "repro.py").read_text(), re.M)
        found.append(Finding(folder.name, folder, float(cap.group(1)) if cap else DEFAULT_CAP_S))
    return found


def diff_files(diff: Path) -> list[str]:
    """The files ``diff`` changes, relative to site-packages (``vllm/...``), in order."""
    files = []
    for line in diff.read_text().splitlines():
        if line.startswith("+++ "):
            path = line[4:].split("\t")[0].strip()
            if not path.startswith("b/"):
                raise FindingError(f"{diff}: expected paths as b/vllm/..., got {path!r}")
            files.append(path[2:])
    if not files:
        raise FindingError(f"{diff}: not a unified diff (no +++ line)")
    return files


def module_of(relative: str) -> str:
    if not relative.endswith(".py") or relative.endswith("__init__.py"):
        raise FindingError(f"{relative}: only plain modules can be overlaid, not packages or non-Python files")
    return relative[:-3].replace("/", ".")


def build_patched(finding: Finding, scratch: Path) -> tuple[str, list[str]]:
    """Apply the finding's first diff that applies (``Finding.diffs``) to copies of the files of the
    vLLM under test; write the overlay into ``scratch/overlay``.

    Returns the diff's name and the patched module names. Raises ``FindingError`` when none applies
    (the release moved on, or the diffs are for others), with what ``patch`` said of each."""
    refusals = []
    for diff in finding.diffs:
        try:
            return diff.name, _apply(diff, scratch)
        except FindingError as exc:
            refusals.append(str(exc))
    raise FindingError("; ".join(refusals))


def _apply(diff: Path, scratch: Path) -> list[str]:
    tree = scratch / "tree"
    shutil.rmtree(scratch, ignore_errors=True)
    tree.mkdir(parents=True)
    modules = {}
    for relative in diff_files(diff):
        module = module_of(relative)
        try:
            source = overlay.module_source(module)
        except overlay.OverlayError as exc:
            raise FindingError(str(exc)) from None
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, tree / relative)
        modules[module] = tree / relative
    result = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-d", str(tree),
                             "-i", str(diff)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        said = " ".join((result.stdout + result.stderr).split())[:300]
        raise FindingError(f"{diff} does not apply to vLLM {installed_vllm()}: {said}")
    try:
        overlay.build_sources(scratch / "overlay", {m: p.read_text() for m, p in modules.items()})
    except overlay.OverlayError as exc:
        raise FindingError(str(exc)) from None
    return list(modules)


@dataclass
class Run:
    """One repro run: its exit status, the line it printed, its seconds, and what its processes left
    in /dev/shm that the runner removed."""

    returncode: int
    line: str
    seconds: float
    shm_removed: list[str] = field(default_factory=list)


def run_repro(finding: Finding, workdir: Path, pythonpath: Path | None, args: tuple[str, ...] = ()) -> Run:
    """Run ``repro.py`` in its own session, bounded by its cap plus ``MARGIN_S``; its output goes to
    ``workdir``. A run past the bound is killed with its whole group and reported as ``-9``.

    /dev/shm is left as the run found it: its processes carry a ``ShmClaim`` token (read every
    ``SHM_WATCH_S`` while they live), and once they are all gone what they mapped or held, and
    the Ray channel semaphores named after one of their PIDs (``sem.hdr<pid>-*``, ``sem.obj<pid>-*``:
    nobody unlinks them when Ray's processes are killed, by the repro or by this runner), are
    removed and listed in ``Run.shm_removed``. Entries that were there before, or that other
    processes made meanwhile, stay."""
    workdir.mkdir(parents=True, exist_ok=True)
    # What a repro's processes leave in /tmp (vLLM's /tmp/<uuid> IPC sockets and /tmp/vllm_dist_*
    # file stores, multiprocessing's pymp-*, Ray's session folders) goes to a folder of this run,
    # removed with what it holds. Short: Ray's socket paths under it must stay within 107 bytes.
    ipc = tempfile.mkdtemp(prefix="up-")
    env = process_env(**STOCK_ENV, VLLM_RPC_BASE_PATH=ipc, TMPDIR=ipc)
    env = {k: v for k, v in env.items() if not k.startswith("TESTBED_")}
    shm = ShmClaim.take()
    env.update(shm.env)  # only the runner reads it: which processes, and so which /dev/shm entries, are ours
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
    started = time.monotonic()
    log_path = workdir / "output.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(finding.repro), *args], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        shm.watch(SHM_WATCH_S)
        try:
            returncode = proc.wait(timeout=finding.cap_s + MARGIN_S)
        except subprocess.TimeoutExpired:
            returncode = -9
        finally:
            # Its readers, Ray nodes and their workers (Ray gives each its own process group, in
            # this session): only this run's session, bounded. Read once more before the kill:
            # what they map now is left behind by SIGKILL.
            shm.record(process.session_pids(proc.pid))
            process.kill_session(proc.pid)
            proc.wait()
            removed = shm.remove_new()
            shutil.rmtree(ipc, ignore_errors=True)
    seconds = time.monotonic() - started
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    verdicts = [ln for ln in lines if ln.startswith(_PREFIXES)]
    line = (verdicts or lines or ["(no output)"])[-1].strip()
    if returncode == -9:
        line = f"killed by the runner after {finding.cap_s + MARGIN_S:.0f} s (past the repro's own cap): {line}"
    return Run(returncode, line if line.startswith(BENCH) else line[:400], round(seconds, 1), removed)


@dataclass
class Cost:
    """The fix's cost: the repro's ``--bench`` figure, stock and patched runs interleaved in one run."""

    metric: str
    unit: str
    stock: float  # median of every stock sample
    patched: float
    ratio: float  # median over rounds of patched / stock (each round's medians)
    spread: float  # of those ratios (IQR / median): the machine's noise, reported
    rounds: int


def _bench_samples(run: Run) -> dict:
    if run.returncode != 0 or not run.line.startswith(BENCH):
        raise FindingError(f"--bench run failed (rc={run.returncode}): {run.line[:200]}")
    data = json.loads(run.line[len(BENCH):])
    if not data.get("samples"):
        raise FindingError(f"--bench run gave no samples: {run.line[:200]}")
    return data


def measure_cost(finding: Finding, out: Path, patched: Path, rounds: int) -> Cost:
    """Run ``repro.py --bench`` stock and patched, alternately (the order turned each round), and
    compare: the same machine, the same drift. Raises ``FindingError`` when a bench run fails.
    ``rounds`` >= ``MIN_BENCH_ROUNDS``."""
    medians: dict[str, list[float]] = {"stock": [], "patched": []}
    every: dict[str, list[float]] = {"stock": [], "patched": []}
    data: dict = {}
    for index in range(rounds):
        order = ("stock", "patched") if index % 2 == 0 else ("patched", "stock")
        for side in order:
            run = run_repro(finding, out / finding.name / f"bench-{side}-{index}",
                            patched if side == "patched" else None, ("--bench",))
            data = _bench_samples(run)
            medians[side].append(statistics.median(data["samples"]))
            every[side].extend(data["samples"])
    ratio = stats.paired(medians["patched"], medians["stock"])
    return Cost(data["metric"], data.get("unit", "ms"), round(statistics.median(every["stock"]), 3),
                round(statistics.median(every["patched"]), 3), round(ratio.median, 3), round(ratio.spread, 3), rounds)


@dataclass
class Verdict:
    """One finding: stock and patched runs, and whether each is what the finding claims."""

    finding: str
    release: str
    modules: list[str] = field(default_factory=list)
    fix: str = ""  # the diff that applied: fix.diff, or fix-<release>.diff
    stock: Run | None = None
    patched: Run | None = None
    stock_result: str = ERROR
    patched_result: str = ERROR
    loads: int = 0
    problem: str = ""
    cost: Cost | None = None
    note: str = ""  # what the cost table says instead of a figure

    @property
    def ok(self) -> bool:
        if self.stock_result == NOT_APPLICABLE:
            return True  # nothing to fix here; the table says why
        return self.stock_result == REPRODUCES and self.patched_result == FIXED




def _said(run: Run) -> bool:
    return run.returncode not in _LINES or run.line.startswith(_LINES[run.returncode])


def judge_stock(run: Run) -> str:
    if not _said(run):
        return ERROR
    return {1: REPRODUCES, 0: NOT_REPRODUCED, 3: NOT_APPLICABLE, -9: HANG}.get(run.returncode, ERROR)


def judge_patched(run: Run, loads: int) -> str:
    if loads == 0 or not _said(run):
        return ERROR  # the patched module never ran, or the repro crashed: nothing about the fix
    return {0: FIXED, 1: NOT_FIXED, -9: HANG}.get(run.returncode, ERROR)


def run_one(finding: Finding, out: Path, bench_rounds: int = 0) -> Verdict:
    verdict = Verdict(finding.name, installed_vllm())
    # Stock first: on another release (VLLM=) the diff may not apply, and whether the bug is
    # there is still the answer a user asks for.
    verdict.stock = run_repro(finding, out / finding.name / "stock", None)
    verdict.stock_result = judge_stock(verdict.stock)
    if verdict.stock_result == NOT_APPLICABLE:
        verdict.patched_result = NOT_APPLICABLE
        return verdict
    try:
        verdict.fix, verdict.modules = build_patched(finding, out / finding.name / "scratch")
    except FindingError as exc:
        verdict.problem = str(exc)
        return verdict
    scratch = out / finding.name / "scratch" / "overlay"
    verdict.patched = run_repro(finding, out / finding.name / "patched", scratch)
    verdict.loads = sum(overlay.loads(scratch).get(m, 0) for m in verdict.modules)
    verdict.patched_result = judge_patched(verdict.patched, verdict.loads)
    if verdict.loads == 0:
        verdict.problem = f"no process imported {', '.join(verdict.modules)} from the patched overlay"
    elif bench_rounds and verdict.ok and not finding.has_bench:
        verdict.note = "no --bench in repro.py: its REPORT.md gives the fix's cost"
    elif bench_rounds and verdict.ok:
        try:
            verdict.cost = measure_cost(finding, out, scratch, bench_rounds)
        except FindingError as exc:
            verdict.problem = f"cost not measured: {exc}"
    return verdict


def installed_vllm() -> str:
    """The vLLM whose code the repros run: the installed release, or ``VLLM=``'s overlay (``0.33.0@<hash>``)."""
    return vllm_source.running_line()


def write_report(verdicts: list[Verdict], out: Path) -> dict:
    """``upstream.json`` (the data) and ``upstream.md`` (the table, drawn from it); return the data."""
    data = {"vllm": vllm_source.vllm_line(vllm_source.running()), "ok": all(v.ok for v in verdicts),
            "findings": [asdict(v) for v in verdicts]}
    (out / "upstream.json").write_text(json.dumps(data, indent=1))
    (out / "upstream.md").write_text(markdown(data) + "\n")
    return data


def _cell(result: str, run: dict | None, expected: str) -> str:
    mark = result if result in (expected, NOT_APPLICABLE) else f"**{result}** (red)"
    return f"{mark}: {run['line']}" if run else mark


def markdown(data: dict) -> str:
    lines = [f"# make upstream ({data['vllm']})", "",
             "| finding | release | stock | patched (fix.diff) | s (stock / patched) |", "|---|---|---|---|---|"]
    for v in data["findings"]:
        stock = _cell(v["stock_result"], v["stock"], REPRODUCES)
        patched = "-" if v["patched_result"] == NOT_APPLICABLE else _cell(v["patched_result"], v["patched"], FIXED)
        if v.get("fix") and v["fix"] != "fix.diff":
            patched += f" (with {v['fix']})"
        if v["problem"]:
            patched += f" ({v['problem']})"
        seconds = " / ".join(f"{r['seconds']:.0f}" for r in (v["stock"], v["patched"]) if r) or "-"
        lines.append(f"| [{v['finding']}](../../findings/{v['finding']}/REPORT.md) | {v['release']} | "
                     f"{stock.replace('|', '/')} | {patched.replace('|', '/')} | {seconds} |")
    costs = [v for v in data["findings"] if v.get("cost") or v.get("note")]
    if costs:
        lines += ["", "The fixes' cost (`repro.py --bench`, stock and patched runs interleaved in this run; "
                  "spread: IQR / median of the rounds' ratios):", "",
                  "| finding | what is timed | stock | patched | patched / stock | spread | rounds |",
                  "|---|---|---|---|---|---|---|"]
        for v in costs:
            c = v["cost"]
            if not c:
                lines.append(f"| {v['finding']} | {v['note']} | | | | | |")
                continue
            lines.append(f"| {v['finding']} | {c['metric']} | {c['stock']:.3g} {c['unit']} | "
                         f"{c['patched']:.3g} {c['unit']} | **{c['ratio']:.2f}** | {c['spread']:.0%} | {c['rounds']} |")
    return "\n".join(lines)
