"""Known failures match only the failure they name (issue 17, item 2)."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.known import COMPONENT, Signature

pytestmark = pytest.mark.unit

RACE = Signature(r"saw bytes written after enqueue")


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the point is any type
        return caught


def test_the_named_failure_matches() -> None:
    assert RACE.mismatch(_raised(AssertionError("reader 1 saw bytes written after enqueue")), "") is None


def test_the_pattern_may_be_in_the_report_text_rather_than_the_message() -> None:
    assert RACE.mismatch(_raised(AssertionError()), "E  AssertionError: reader 1 saw bytes written after enqueue") is None


def test_pytest_fail_counts_as_an_assertion() -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        pytest.fail("reader 2 saw bytes written after enqueue")
    assert RACE.mismatch(info.value, "") is None


def test_another_assertion_in_a_known_failing_test_is_a_new_failure() -> None:
    """A deliberately different failure: bytes fine, but a reader went missing."""
    why = RACE.mismatch(_raised(AssertionError("assert [1] == [1, 2]")), "")
    assert why and "does not match" in why


def test_another_exception_type_is_a_new_failure() -> None:
    why = RACE.mismatch(_raised(TimeoutError("readers answered [] of 1 within 30 s; dead: none")),
                        "saw bytes written after enqueue")
    assert why and "raised TimeoutError" in why


def test_every_component_known_failure_names_a_reason_per_mode_and_a_pattern() -> None:
    for prop, known in COMPONENT.items():
        assert known.env in ("TESTBED_BROADCAST", "TESTBED_DETACH"), prop
        assert known.reasons and set(known.reasons) <= {"off", "upstream"}, prop
        assert known.signature.pattern and known.signature.exceptions, prop


INNER_CONFTEST = '''
import pytest
from vllm_zerocopy_testbed.known import Signature, judge_report

@pytest.fixture
def known(request):
    request.node.testbed_known = Signature(r"saw bytes written after enqueue")
    request.applymarker(pytest.mark.xfail(strict=True, reason="the race"))

@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    judge_report(outcome.get_result(), call.excinfo.value if call.excinfo else None,
                 getattr(item, "testbed_known", None))
'''
INNER_TESTS = '''
def test_the_race(known):
    assert False, "reader 1 saw bytes written after enqueue"

def test_a_reader_lost(known):
    assert [1] == [1, 2], "readers answered"

def test_a_timeout(known):
    raise TimeoutError("saw bytes written after enqueue")

def test_fixed(known):
    pass
'''


def test_pytest_reports_a_mismatched_known_failure_as_failed(tmp_path) -> None:
    """The same wrapper as tests/conftest.py's, in a real pytest run: the named failure is xfailed,
    a different assertion and another exception type are failures, a pass is strict-red."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-q", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert "XFAIL test_inner.py::test_the_race" in out, out
    assert "FAILED test_inner.py::test_a_reader_lost" in out and "does not match" in out, out
    assert "FAILED test_inner.py::test_a_timeout" in out and "raised TimeoutError" in out, out
    assert "FAILED test_inner.py::test_fixed" in out and "XPASS(strict)" in out, out
