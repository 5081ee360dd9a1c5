"""The live-cluster suites (e2e, faults): the single-process reference first, then one cluster
per profile, a report at the end.

Profiles are executor x modes (``TESTBED_E2E_EXECUTORS``, ``TESTBED_E2E_MODES``;
``make e2e EXECUTOR=... MODES=...``). Each profile's cluster is brought up once,
its workloads run once (session fixtures), and the tests are checkers over what
was recorded. A cluster already up with the same settings (``make up``) is used
and left up; one the session started is always brought down, also on failure.
``TESTBED_CLUSTER=compose`` (default) or ``local``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from typing import Iterator

import pytest

from vllm_zerocopy_testbed.checker.bitexact import first_answers
from vllm_zerocopy_testbed.cluster import cluster_from_env
from vllm_zerocopy_testbed.cluster.reference import ReferenceServer
from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.host_config import Profile, warm_channel_timeout
from vllm_zerocopy_testbed.known import E2E
from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.report import TestResult, faults_table, write_faults
from live.suite import (EVIDENCE, FAULTS, HISTORY, MODEL_SPEC, MODES_CHOSEN, PROFILES, REPORT,
                       REQUEST_TIMEOUT_S, RUN_DIR, SETTINGS, SIZES, STARTED_BY_RUN, STRUCTURED_UNMET,
                       LiveCluster, Reference, timeouts)
from vllm_zerocopy_testbed.workload.catalog import reference_specs
from vllm_zerocopy_testbed.workload.runner import Runner


class _Progress(logging.Handler):
    """The testbed's own INFO lines (a server or cluster starting, up, down; each workload sent and
    answered; what a long start waits for, every 15 s) on the terminal as they happen, with the
    time since the session began: pytest would otherwise hold them until a test fails, and a run
    of many minutes would say nothing for minutes on end. Written as pytest's own live log
    is, with capture suspended; called from the main thread only."""

    def __init__(self, config: pytest.Config) -> None:
        super().__init__(logging.INFO)
        self.config = config
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is None or threading.current_thread() is not threading.main_thread():
            return
        seconds = int(time.monotonic() - self.started)
        try:
            line = f"[{seconds // 60:02d}:{seconds % 60:02d}] {record.getMessage()}"
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                reporter.write_line(line)
        except Exception:  # a progress line must never fail the run
            self.handleError(record)


PROGRESS_LOGGER = "vllm_zerocopy_testbed"


def _show_progress(config: pytest.Config) -> None:
    """Once, for a session that runs live suites (not for unit and component runs)."""
    package = logging.getLogger(PROGRESS_LOGGER)
    if any(isinstance(h, _Progress) for h in package.handlers):
        return
    package.addHandler(_Progress(config))
    if package.getEffectiveLevel() > logging.INFO:
        package.setLevel(logging.INFO)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only the live suites' tests (marked with their report row) run once per profile.
    if "profile" in metafunc.fixturenames and metafunc.definition.get_closest_marker("suite"):
        metafunc.parametrize("profile", PROFILES, ids=str, scope="session")


# Within a profile: requests without logprobs first (on the compiled-graph executor the
# first logprobs request kills the engine: findings/cgraph-raylet-writeacquire), the cross-profile checks last.
SUITE_ORDER = ("plain", "bad-input", "embeds", "logprobs", "concurrent", "sequential", "restart", "smoke",
               "structured", "across", "nemesis")


# Suites with servers of their own on this host, run before any cluster is up (an idle cluster's
# pinned ranks spin on both cores).
FIRST = ("arena",)


def _order(item: pytest.Item) -> tuple[int, int]:
    marker = item.get_closest_marker("suite")
    suite = marker.args[0] if marker else "smoke"
    if suite in FIRST:
        return (-1, FIRST.index(suite))
    callspec = getattr(item, "callspec", None)
    profile = callspec.params.get("profile") if callspec else None
    # On the profile's own cluster the structured suite runs first, on the fresh start where its
    # race was measured (its own clusters: last, in place of the profile's, which it brings down).
    if suite == "structured" and not STRUCTURED_UNMET:
        return (PROFILES.index(profile) if profile in PROFILES else len(PROFILES), -1)
    return (PROFILES.index(profile) if profile in PROFILES else len(PROFILES),
            SUITE_ORDER.index(suite) if suite in SUITE_ORDER else len(SUITE_ORDER))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        _mark_known_failures(item)
    items.sort(key=_order)
    # Last of the hooks: `-m`/`-k` have deselected what does not run.
    if any(item.get_closest_marker("suite") for item in items):
        _show_progress(config)


def _mark_known_failures(item: pytest.Item) -> None:
    """``@pytest.mark.known(prop)``: a strict xfail where the item's profile is known to fail ``prop``.

    Marked at collection, so that a workload fixture failing in set-up counts too.
    With modes chosen (``MODES=off``) nothing is expected: known failures are red.
    Expected only as itself: a failure that does not match the property's signature
    (``known.E2E``) is red (``tests/conftest.py`` judges the report).
    """
    callspec = getattr(item, "callspec", None)
    profile = callspec.params.get("profile") if callspec else None
    if profile is None or MODES_CHOSEN:
        return
    for marker in item.iter_markers("known"):
        known = E2E[marker.args[0]]
        reason = known.reason_on(profile)
        if reason:
            item.testbed_known = known.signature
            # Only a failed check counts as the known failure; a cluster or reference that
            # cannot start (ClusterStartError and the like) stays an error.
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True,
                                              raises=(AssertionError, pytest.fail.Exception)))


@pytest.fixture(scope="session")
def reference() -> Iterator[Reference]:
    """Run every comparable spec once against the single-process server (before any cluster), and
    keep it up for the session: the latency checks pair each cluster request with it."""
    specs = reference_specs(SIZES, int(SETTINGS["TESTBED_MAX_NUM_SEQS"]), MODEL_SPEC)
    with ReferenceServer(SETTINGS) as server:
        runner = Runner(server.base_url, SETTINGS["TESTBED_SERVED_MODEL"], HISTORY, "reference", REQUEST_TIMEOUT_S,
                        awake=server.awake)
        records = runner.run("reference", specs)
        verdict = timeouts.check(records)
        if not verdict.ok:
            pytest.fail(f"the single-process reference failed: {verdict}\n{server.logs(40)}")
        # Paused between its requests: idle, it polls on the cluster's cores (~10% of one).
        server.pause()
        yield Reference(first_answers(records), records, runner)
    assert not server.leftovers(), f"the reference server left behind: {server.leftovers()}"


RUN_SETTINGS = ("TESTBED_SERVE_ARGS", "TESTBED_MQ_TIMELINE", "TESTBED_MAX_MODEL_LEN", "TESTBED_NODE_ENV", "TESTBED_MODEL",
                "TESTBED_MAX_NUM_SEQS")


@pytest.fixture(scope="session")
def cluster(profile: Profile, reference: Reference) -> Iterator[LiveCluster]:
    """The profile's cluster: reused when already up with the same settings, else brought up and down."""
    lacks = vllm_source.running()["lacks"]
    if profile.executor.value == "cgraph" and "compiled-graph executor" in lacks:
        # vLLM >= 0.33.0 ignores VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0: the profile would run V2 under cgraph's name.
        pytest.skip(f"{profile}: vLLM {vllm_source.running_line()} has no compiled-graph executor (removed in 0.33.0)")
    # A compiled-graph cluster after an earlier one of the run warmed the compile cache: a 30 s channel bound.
    overrides = {**profile.env(), **warm_channel_timeout(profile, SETTINGS.values, bool(STARTED_BY_RUN))}
    backend = cluster_from_env(up_timeout=900, overrides=overrides)
    # Beyond the profile, what a run may set (make faults: the batch budget, the timeline).
    wanted = {**overrides, **{k: backend.settings.values.get(k, "") for k in RUN_SETTINGS}}
    if backend.serves(wanted):
        yield LiveCluster(backend, profile)
        return
    with backend as running:
        STARTED_BY_RUN.add(str(profile))
        yield LiveCluster(running, profile)
    # Hygiene: what we started is gone (containers, network, Ray processes, /dev/shm files).
    left = backend.leftovers()
    assert not left, f"{profile}: the cluster left behind after down: {left}"


# -- report -----------------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """What a test's checkers judge, its fixtures' included, is saved as that test's evidence."""
    EVIDENCE.start(item.nodeid)
    yield
    EVIDENCE.start(None)


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    marker = item.get_closest_marker("suite")
    if marker is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    params = getattr(item, "callspec", None)
    profile = params.params.get("profile") if params else None
    message = report.longreprtext[-3000:] if report.failed else getattr(report, "wasxfail", "")
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        message = report.longrepr[2].removeprefix("Skipped: ")  # (file, line, reason): the report says why
    REPORT.results.append(TestResult(test=item.nodeid.split("::", 1)[-1], suite=marker.args[0],
                                     profile=str(profile) if profile else "all", outcome=_outcome(report),
                                     duration_s=report.duration, message=message))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT.results:
        return
    written = REPORT.write(RUN_DIR, HISTORY.records(), HISTORY.events())
    terminalreporter.section("vllm-zerocopy-testbed e2e report")
    terminalreporter.write_line(REPORT.table(HISTORY.records()))
    if FAULTS:
        written += write_faults(RUN_DIR, FAULTS)
        terminalreporter.write_line(faults_table(FAULTS))
    terminalreporter.write_line(f"report: {', '.join(str(p.relative_to(REPO_ROOT)) for p in written)}")
