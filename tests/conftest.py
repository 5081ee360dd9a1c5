"""Modes under test and the failures each mode is known to have.

Without ``TESTBED_BROADCAST`` / ``TESTBED_DETACH`` (``TESTBED_INFLIGHT``, ``TESTBED_ARENA``) in the environment every
mode runs, and a known failure is a strict xfail: if a fix-off mode stops
failing, the suite turns red. With one of them set, only that mode runs and
every property must hold, so ``TESTBED_BROADCAST=off TESTBED_DETACH=off make
test-component`` shows which tests the fixes keep green.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
from packaging.version import Version

from vllm_zerocopy_testbed.config import ARENA_ENV, BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV, RAY_AUTH_DEFAULT, PatchMode
from vllm_zerocopy_testbed.known import COMPONENT, judge_report
from vllm_zerocopy_testbed import vllm_source

# The live-cluster suites' fixtures and hooks (tests/e2e, tests/faults), registered once.
pytest_plugins = ["live.plugin"]

UPSTREAM = PatchMode.UPSTREAM


def _installed_vllm() -> Version:
    """The version of the vLLM code this run imports (an overlay's own, ``VLLM=``), not the wheel's."""
    return Version(vllm_source.running()["version"])


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_vllm(path)``: skip, saying so, where the vLLM under test has no such path."""
    for marker in item.iter_markers("needs_vllm"):
        info = vllm_source.running()
        missing = [path for path in marker.args if path in info["lacks"]]
        if missing:
            pytest.skip(f"vLLM {info['version']} ({info['origin']}) has no {', '.join(missing)}")


def _upstream_lacks(prop: str) -> str | None:
    """Return why the installed vLLM predates the fix a property needs, if it does."""
    installed = _installed_vllm()
    if prop == "zero_copy" and installed < Version("0.27.0"):
        return f"vLLM {installed} predates PR 48442 (0.27.0)"
    if prop.startswith("detach") and installed < Version("0.20.0"):
        return f"vLLM {installed} predates PR 35736 (0.20.0)"
    return None


def modes_under_test(env: str) -> list[PatchMode]:
    chosen = os.environ.get(env)
    return [PatchMode.parse(chosen, variable=env)] if chosen else list(PatchMode)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, env in (("broadcast_mode", BROADCAST_ENV), ("detach_mode", DETACH_ENV),
                         ("inflight_mode", INFLIGHT_ENV), ("arena_mode", ARENA_ENV)):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, modes_under_test(env), ids=lambda m: m.value)


@pytest.fixture
def log_lines():
    """``log_lines(logger)``: a list of the messages ``logger`` emits from then on, at INFO and above,
    growing as it logs (from any thread); the logger's level and handlers are restored after the test.
    The level is set with setLevel: a logger caches ``isEnabledFor``, only setLevel clears that cache,
    and an INFO check made earlier in the process (at the effective WARNING) would keep answering False."""
    import logging

    attached: list[tuple[logging.Logger, logging.Handler, int]] = []

    def capture(logger: logging.Logger) -> list[str]:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        attached.append((logger, handler, logger.level))
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        return lines

    yield capture
    for logger, handler, level in reversed(attached):
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def expect(request: pytest.FixtureRequest):
    """``expect(property, mode)``: mark the test a strict xfail where ``mode`` is known to fail."""

    def _expect(prop: str, mode: PatchMode) -> None:
        request.node.user_properties.append(("property", prop))  # junit.xml: make check's row for the test
        known = COMPONENT[prop]
        if os.environ.get(known.env):
            return  # the run named its mode: the property must hold
        reason = known.reasons.get(mode.value)
        if reason and mode is UPSTREAM and known.upstream_needs in vllm_source.running()["lacks"]:
            reason = None  # this vLLM predates the path the upstream failure lives in (make matrix: 0.26.0)
        if reason:
            request.node.testbed_known = known.signature  # expected only as itself
        elif mode is UPSTREAM:
            reason = _upstream_lacks(prop)  # an old vLLM lacks the fix: any failure of it is expected
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))

    return _expect


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A known failure is expected only as itself: one that does not match its signature
    (``known.py``) is turned back into a failure, with the reason in the report.

    The garbage collector is off while pytest formats the report: CPython 3.11.7 raised
    ``SystemError: AST constructor recursion depth mismatch`` from pytest's ``ast.parse`` of a
    test's source (an INTERNALERROR that ends the run) when a finalizer (shared memory, ZMQ
    frames) ran in the middle of it; measured twice in a component run, at different tests."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        outcome = yield
    finally:
        if collecting:
            gc.enable()
    judge_report(outcome.get_result(), call.excinfo.value if call.excinfo else None,
                 getattr(item, "testbed_known", None))


RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
_rpc_dir: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """vLLM binds its ZMQ IPC sockets (MessageQueue readers, engine core) under
    ``VLLM_RPC_BASE_PATH``, by default /tmp, and a process that is killed leaves them there:
    a test-core run left ~120 in /tmp. This run's vLLM processes, in it and started by it,
    get a directory of their own, removed when the run ends."""
    global _rpc_dir
    if RPC_BASE_ENV not in os.environ:
        _rpc_dir = tempfile.mkdtemp(prefix="testbed-ipc-")
        os.environ[RPC_BASE_ENV] = _rpc_dir
    # Every Ray process the tests start, in this process or its children, without token
    # authentication unless the user set it: a ~/.ray/auth_token left by any earlier local
    # ray.init() otherwise makes local nodes refuse to join (config.RAY_AUTH_DEFAULT).
    for name, value in RAY_AUTH_DEFAULT.items():
        os.environ.setdefault(name, value)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The heap probe files of vLLM processes this run started and killed (a normal exit removes
    its own): only files whose process is gone are removed. Then the run's IPC socket directory."""
    from vllm_zerocopy_testbed.observe import heap

    heap.prune()
    if _rpc_dir is not None:
        shutil.rmtree(_rpc_dir, ignore_errors=True)
