"""Two runs on one machine, side by side: each passes, and neither removes what it did not make.

Run A is ``make test-smoke``: a compose cluster (PP=2 x TP=2), the single-process reference server
on the host, the e2e smoke checks through the API. Run B, started at the same moment, is a component
suite that starts and removes Ray clusters and vLLM processes on the host (``test_local_nodes``,
``test_cgraph_deadlock``): the suites whose /dev/shm hygiene once removed every new ``psm_*`` /
``sem.*`` on the machine, another run's included. While they run, this test plays a third run: every
30 s it makes a ``psm_*`` and a ``sem.*`` in /dev/shm (held by no process of A or B, as a crashed
worker of another run leaves them). Each run must pass, its report must be its own, and every file of
the third run must still be there after both.

Two runs on two cores are slow: the bounds are the runs' own (pytest-timeout, every wait of the
testbed) plus this test's, which ends both sessions if they pass it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.cluster import locks
from vllm_zerocopy_testbed.cluster.compose import ComposeCluster
from vllm_zerocopy_testbed.cluster.process import kill_session
from vllm_zerocopy_testbed.cluster.shm import SHM_DIR, owner_pids
from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.host_config import ClusterSettings

pytestmark = [pytest.mark.concurrent, pytest.mark.timeout(1800)]

BOUND_S = 1500  # both runs: A ~5 min, B ~4 min alone (two cores, shared)
COMPONENT = "tests/component/test_local_nodes.py tests/component/test_cgraph_deadlock.py"


RUN_ENV = "TESTBED_SIDE_BY_SIDE_RUN"  # every process of a run carries it (the servers it starts too)


def _start(args: list[str], run: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    # SIGINT as the default: a test started in the background inherits it ignored, and then the
    # runs could not be asked to tear down (_end).
    with open(log, "wb") as out:
        return subprocess.Popen(["make", *args, f"RUN={run}"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, RUN_ENV: run}, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _end(proc: subprocess.Popen[bytes], run: str) -> None:
    """A run still going: SIGINT (pytest tears its fixtures down: the cluster, the servers), then
    SIGKILL to every process of the run, and its compose project down (the projects whose lock its
    pytest held: the lock file names its report folder)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    kill_session(proc.pid)
    proc.wait(timeout=30)
    for pid in owner_pids(run, RUN_ENV):  # the servers it started in sessions of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for lock in locks.LOCK_DIR.glob("compose-*.lock"):
        if f"reports/{run}/" in lock.read_text(errors="replace") and locks.is_free(lock.stem):
            project = lock.stem.removeprefix("compose-")
            ComposeCluster(ClusterSettings.from_env({"COMPOSE_PROJECT_NAME": project, "TESTBED_INSTANCE": "0"})).down()


def _junit(path: Path) -> dict[str, int]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, f"{path}: no testsuite"
    return {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}


def test_an_e2e_run_and_a_component_run_side_by_side_pass_and_keep_to_their_own() -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = {"e2e": f"concurrent-{stamp}-e2e", "component": f"concurrent-{stamp}-component"}
    reports = {name: REPO_ROOT / "reports" / run for name, run in runs.items()}
    for folder in reports.values():
        folder.mkdir(parents=True)
    procs = {
        # one profile, one cluster: the smoke checks of v2 under testbed
        "e2e": _start(["test-smoke", "EXECUTOR=v2", "MODES=testbed"], runs["e2e"], reports["e2e"] / "make.log"),
        # make test-component writes no report of its own: the junit file is this run's
        "component": _start(["test-component"], runs["component"], reports["component"] / "make.log",
                            PYTEST_ARGS=f"{COMPONENT} -p no:cacheprovider "
                                        f"--junitxml={reports['component'] / 'junit.xml'}"),
    }
    foreign: list[Path] = []
    try:
        # Every 30 s from 20 s in, while either runs, a third run's pair of files appears: neither run's.
        # A hygiene step that removes what appeared since its start takes any pair made within its span.
        deadline, next_pair = time.monotonic() + BOUND_S, time.monotonic() + 20
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if time.monotonic() >= next_pair:
                tag = uuid.uuid4().hex[:8]
                foreign += [SHM_DIR / f"psm_testbed_foreign_{tag}", SHM_DIR / f"sem.testbed_foreign_{tag}"]
                for path in foreign[-2:]:
                    path.write_bytes(b"\0" * 4096)
                next_pair += 30
            time.sleep(1)
        late = [name for name, p in procs.items() if p.poll() is None]
        tails = {name: (reports[name] / "make.log").read_text(errors="replace")[-3000:] for name in procs}
        assert not late, f"still running after {BOUND_S} s: {late}\n" + "\n".join(tails[n] for n in late)
        for name, proc in procs.items():
            assert proc.returncode == 0, f"run {name} failed ({proc.returncode}):\n{tails[name]}"
        for name, folder in reports.items():
            counts = _junit(folder / "junit.xml")
            assert counts["tests"] > counts["skipped"] and not counts["failures"] and not counts["errors"], \
                f"run {name}: {counts}"
        gone = [str(p) for p in foreign if not p.exists()]
        assert foreign and not gone, f"a run removed another run's files: {gone} (of {len(foreign)})"
    finally:
        for name, proc in procs.items():
            _end(proc, runs[name])
        for path in foreign:
            path.unlink(missing_ok=True)
