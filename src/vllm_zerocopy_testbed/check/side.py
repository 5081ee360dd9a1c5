"""One side's suites: pytest under the side's overlay, every mode ``upstream``, bounded; per test outcome.

The run is a child process in a session of its own, waited on with ``wait4`` so that its peak
RSS (the largest process of its tree, ``ru_maxrss``) is its own and not the other side's; /dev/shm
is sampled while it runs. Past the side's bound it gets SIGINT (pytest tears down and writes
junit.xml), then SIGKILL for whatever of its session is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vllm_zerocopy_testbed.check.compare import FAILED, HANG, PASSED, SKIPPED, CaseOutcome, first_line, is_hang
from vllm_zerocopy_testbed.check.resolve import Side
from vllm_zerocopy_testbed.check.suites import nodeid_from_junit, path_of, property_of
from vllm_zerocopy_testbed.cluster.process import kill_session, session_pids, signal_group
from vllm_zerocopy_testbed.config import ARENA_ENV, BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV, REPO_ROOT, process_env

MODE_ENVS = (BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV, ARENA_ENV)
# Every path runs vLLM's own code: a known failure is a plain failure, and only that mode runs.
UPSTREAM_ENV = {name: "upstream" for name in MODE_ENVS}
SHM = Path("/dev/shm")
TEARDOWN_S = 60.0
EVIDENCE_LINES = 14
_RESULT = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


@dataclass
class ShmUse:
    """/dev/shm files a side's processes mapped: the most bytes at once, and those left after it."""

    peak_bytes: int = 0
    left: list[str] = field(default_factory=list)
    left_bytes: int = 0


@dataclass
class SideRun:
    """What one side's run left: per test outcome, its exit, its bound, its memory."""

    label: str
    outcomes: list[CaseOutcome]
    returncode: int | None
    seconds: float
    junit: str
    log: str
    bound_passed: str = ""  # "": finished within its bound
    error: str = ""  # the testbed's own error (pytest could not run the suites)
    peak_rss_bytes: int = 0
    shm: ShmUse = field(default_factory=ShmUse)


def side_env(side: Side) -> dict[str, str]:
    """The environment a side's processes get: this one's, its overlay, every mode ``upstream``."""
    return side.env({**process_env(), **UPSTREAM_ENV})


def _mapped_shm(pids: list[int]) -> set[str]:
    """The /dev/shm files the processes ``pids`` have mapped now (their ``/proc/<pid>/maps``)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            at = line.find(" /dev/shm/")
            if at >= 0:
                names.add(line[at + len(" /dev/shm/"):].removesuffix(" (deleted)").strip())
    return names


def _size(name: str) -> int | None:
    try:
        return (SHM / name).stat().st_blocks * 512
    except OSError:
        return None


class ShmWatch:
    """/dev/shm as one side's processes use it: the files they map, sampled (so that files of this
    machine's other runs are not counted): the most bytes at once, and the files left after the side."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.seen: set[str] = set()
        self.use = ShmUse()

    def sample(self) -> None:
        mapped = _mapped_shm(session_pids(self.sid))
        self.seen |= mapped
        self.use.peak_bytes = max(self.use.peak_bytes, sum(_size(n) or 0 for n in mapped))

    def finish(self) -> ShmUse:
        left = {n: _size(n) for n in self.seen}
        self.use.left = sorted(n for n, b in left.items() if b is not None)
        self.use.left_bytes = sum(b for b in left.values() if b is not None)
        return self.use


def run_bounded(cmd: list[str], *, env: dict[str, str], log: Path, bound_s: float,
                tick: Callable[[float], None] | None = None, tick_s: float = 15.0
                ) -> tuple[int | None, str, int, ShmUse, float]:
    """Run ``cmd`` (output to ``log``) at most ``bound_s``; return its exit status (None: killed),
    "" or that it passed its bound, its tree's peak RSS in bytes, its /dev/shm use, its seconds."""
    start = time.monotonic()
    bound = ""
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        watch = ShmWatch(proc.pid)
        next_tick = start + tick_s
        deadline, interrupted = start + bound_s, None
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                now = time.monotonic()
                watch.sample()
                if tick is not None and now >= next_tick:
                    tick(now - start)
                    next_tick = now + tick_s
                if interrupted is None and now >= deadline:
                    bound = f"did not finish within {bound_s:.0f} s"
                    signal_group(proc, signal.SIGINT)
                    interrupted = now
                elif interrupted is not None and now >= interrupted + TEARDOWN_S:
                    kill_session(proc.pid)
                time.sleep(0.5)
        except BaseException:  # Ctrl-C of the check itself: nothing of the side is left running
            signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=TEARDOWN_S)
            finally:
                kill_session(proc.pid)
            raise
        kill_session(proc.pid)  # what its tree left running (a reader, a Ray node)
    return proc.returncode, bound, usage.ru_maxrss * 1024, watch.finish(), time.monotonic() - start


def run_side(side: Side, tests: list[str], out: Path, bound_s: float,
             say: Callable[[str], None]) -> SideRun:
    """Run ``tests`` on ``side``'s code; per test outcome from its junit.xml."""
    junit = out / f"junit-{side.label}.xml"
    log = out / f"{side.label}.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *tests, "-m", "unit or component", "-v", "-p", "no:cacheprovider",
           f"--junitxml={junit}"]

    def tick(elapsed: float) -> None:
        done = [m.groups() for m in map(_RESULT.match, log.read_text(errors="replace").splitlines()) if m]
        failed = sum(1 for _, outcome in done if outcome in ("FAILED", "ERROR"))
        last = done[-1][0].rpartition("::")[2] if done else "starting"
        say(f"  {side.label}: {len(done)} tests done ({failed} failed), last: {last} [{elapsed:.0f} s]")

    rc, bound, rss, shm, seconds = run_bounded(cmd, env=side_env(side), log=log, bound_s=bound_s, tick=tick)
    run = SideRun(side.label, [], rc, round(seconds, 1), str(junit), str(log), bound, peak_rss_bytes=rss, shm=shm)
    if junit.is_file():
        try:
            run.outcomes = parse_junit(junit)
        except ET.ParseError as exc:
            run.error = f"{junit.name} unreadable: {exc}"
    if not run.outcomes and not run.error:
        tail = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-3:]
        run.error = f"pytest ran no test (exit {rc}): {' | '.join(tail)[-400:]}"
    elif rc not in (0, 1, None) and not bound and not run.error:
        run.error = f"pytest exited {rc} (not a test failure: an error of the run itself); see {log}"
    return run


def parse_junit(junit: Path) -> list[CaseOutcome]:
    """Per test outcome from a pytest junit.xml: passed, failed (message, evidence), hang (pytest-timeout),
    skipped (reason); the property its ``expect`` recorded or the one ``suites`` gives it."""
    outcomes = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        nodeid = nodeid_from_junit(case.get("classname", ""), case.get("name", ""))
        recorded = ""
        for prop in case.iter("property"):
            if prop.get("name") == "property":
                recorded = prop.get("value", "")
        outcome, message, text = PASSED, "", ""
        problems = [c for c in case if c.tag in ("failure", "error")]
        skipped = case.find("skipped")
        if problems:
            p = problems[0]
            text = p.text or ""
            message = first_line(p.get("message", "") or text)
            if p.tag == "error":
                message = f"error outside the test body: {message}"
            outcome = HANG if is_hang(message, text) else FAILED
            text = evidence(text)
        elif skipped is not None:
            message = first_line(skipped.get("message", ""))
            # an xfail marked in code: a failure that was expected is still a failure here
            outcome = FAILED if "xfail" in (skipped.get("type", "") + message).lower() else SKIPPED
        outcomes.append(CaseOutcome(nodeid, property_of(nodeid, recorded), path_of(nodeid), outcome, message,
                                    text, float(case.get("time", "0") or 0)))
    return outcomes


def evidence(text: str, lines: int = EVIDENCE_LINES) -> str:
    """A failure's evidence: pytest's ``E`` lines (the assertion and its values), else the text's tail."""
    marked = [l for l in text.splitlines() if l.startswith("E ")]
    chosen = marked or [l for l in text.splitlines() if l.strip()]
    return "\n".join(chosen[:lines] if marked else chosen[-lines:])
