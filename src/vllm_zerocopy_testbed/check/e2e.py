"""The e2e tier per side: ``make test-smoke`` (``FULL=1``: ``make e2e``) on the compose cluster, the
side's code in the node image, the V2 executor, every mode ``upstream``; per test outcome from its
junit.xml. A side whose code cannot serve here (``Overlay.e2e_blocker``) runs no e2e: said so.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vllm_zerocopy_testbed.check.resolve import Side
from vllm_zerocopy_testbed.check.side import MODE_ENVS, SideRun, parse_junit, run_bounded
from vllm_zerocopy_testbed.config import REPO_ROOT, process_env

SMOKE_BOUND_S = 900.0
ENGINE_BOUND_S = 600.0
OUR_DOCKERD = Path("/run/testbed-dockerd.pid")  # scripts/ensure-docker.sh writes it when it starts one
FULL_BOUND_S = 3600.0
# What the tier leaves out: tests of the testbed's own cluster, not of the vLLM under test. The
# compile-cache test skips on whichever side first starts on an empty cache volume and passes on the
# other: a difference of order, which would read as a path NEW to the candidate.
NOT_ABOUT_VLLM = ("tests/e2e/test_smoke.py::test_a_warm_compile_cache_is_loaded_not_rebuilt",)


@dataclass(frozen=True)
class E2eStep:
    target: str  # make target: test-smoke or e2e
    bound_s: float


def step(full: bool) -> E2eStep:
    return E2eStep("e2e", FULL_BOUND_S) if full else E2eStep("test-smoke", SMOKE_BOUND_S)


def command(side: Side, run_dir: str, full: bool) -> list[str]:
    """The make command that runs ``side``'s e2e tier into ``reports/<run_dir>``."""
    deselect = " ".join(f"--deselect {test}" for test in NOT_ABOUT_VLLM)
    return ["make", "--no-print-directory", step(full).target, f"VLLM={side.make_arg}", "EXECUTOR=v2",
            "MODES=upstream", f"RUN={run_dir}", f"PYTEST_ARGS={deselect}"]


def run_side(side: Side, run: str, out: Path, full: bool, say: Callable[[str], None]) -> SideRun:
    """Run the side's e2e tier (bounded); its outcomes with path ``e2e``. The caller first checks that
    both sides can serve (``Side.e2e_blocker``)."""
    run_dir = f"{run}/e2e-{side.label}"
    log = out / f"e2e-{side.label}.log"
    junit = REPO_ROOT / "reports" / run_dir / "junit.xml"
    # make sets the modes per profile (MODES=upstream); the check's own variables must not leak in
    env = {k: v for k, v in process_env().items() if k not in (*MODE_ENVS, "TESTBED_VLLM", "VLLM")}

    def tick(elapsed: float) -> None:
        say(f"  {side.label} e2e ({step(full).target}) running [{elapsed:.0f} s]")

    rc, bound, rss, shm, seconds = run_bounded(command(side, run_dir, full), env=env, log=log,
                                               bound_s=step(full).bound_s, tick=tick, tick_s=30.0)
    result = SideRun(side.label, [], rc, round(seconds, 1), str(junit), str(log), bound, peak_rss_bytes=rss, shm=shm)
    if junit.is_file():
        result.outcomes = parse_junit(junit)
    if not result.outcomes:
        tail = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-3:]
        result.error = f"make {step(full).target} ran no test (exit {rc}): {' | '.join(tail)[-400:]}"
    return result


def ensure_engine(say: Callable[[str], None]) -> Callable[[], None]:
    """Make the Docker engine reachable from the check's own process, before any side runs; return what
    stops it at the end (nothing when it was running already). A side runs in a session of its own that
    is ended with it: an engine its ``make`` started would be killed with it, leaving the next side a
    stale pid file and no engine."""
    ours_before = OUR_DOCKERD.exists()
    run = subprocess.run([str(REPO_ROOT / "scripts/ensure-docker.sh")], capture_output=True, text=True,
                         timeout=ENGINE_BOUND_S, env=process_env())
    if run.returncode != 0:
        raise RuntimeError(f"no Docker engine for the e2e tier: {run.stderr.strip().splitlines()[-1:] or run.stdout}")
    say(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "docker: engine reachable")
    if ours_before or not OUR_DOCKERD.exists():
        return lambda: None

    def stop() -> None:
        done = subprocess.run([str(REPO_ROOT / "scripts/stop-docker.sh")], capture_output=True, text=True,
                              timeout=60, env=process_env())
        say(done.stdout.strip() or done.stderr.strip())
    return stop

