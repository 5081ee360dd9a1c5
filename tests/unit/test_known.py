"""Known failures match only the failure they name."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.known import COMPONENT, E2E, Signature, finding_of

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
        assert known.env in ("TESTBED_BROADCAST", "TESTBED_DETACH", "TESTBED_INFLIGHT", "TESTBED_ARENA"), prop
        assert known.reasons and set(known.reasons) <= {"off", "upstream"}, prop
        assert known.signature.pattern and known.signature.exceptions, prop


def test_a_reason_says_what_fails_and_names_only_findings_that_exist() -> None:
    """A reader follows a reason to its finding's REPORT.md; a reason without one says what fails."""
    reasons = [r for known in COMPONENT.values() for r in known.reasons.values()] + [k.reason for k in E2E.values()]
    for reason in reasons:
        what, _, why = reason.partition(": ")
        assert what and why, f"no 'what fails: why' in {reason!r}"
        folder = finding_of(reason)
        assert folder is None or (REPO_ROOT / folder / "REPORT.md").is_file(), reason
    assert finding_of(E2E["cgraph_logprobs"].reason) == "findings/cgraph-raylet-writeacquire"
    assert finding_of(COMPONENT["race_free_tensor"].reasons["upstream"]) == "findings/53217-oob-send-race"


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


# -- the e2e table (known.E2E), on the failure texts the e2e judge writes ---------------------
CHANNEL_TIMEOUT = (
    "timeouts: 1 problem(s)\n  logprobs/k1: 500 after 64.8 s: InternalServerError: Error code: 500\n"
    "--- server and node logs (cgraph/upstream) ---\n"
    "head-1 | ERROR ray.exceptions.RayChannelTimeoutError: System error: Timed out waiting for object available "
    "to read. ObjectID: 00ffff\nhead-1 | ERROR EngineDeadError: EngineCore encountered an issue.")
DIED_OF_TIMEOUT = ("not run: the engine died in suite 'logprobs' (logprobs/k1: InternalServerError); server log: "
                   "head-1 | ERROR ray.exceptions.RayChannelTimeoutError: System error: Timed out waiting")
DIED_OF_SOMETHING_ELSE = ("not run: the engine died in suite 'logprobs' (logprobs/k1: InternalServerError); "
                          "server log: head-1 | ERROR EngineDeadError\nhead-1 | RuntimeError: shape mismatch")
WRONG_TOKENS = "tokens = reference: 1 problem(s)\n  logprobs/k5: choice 0: token 3 is 17, the reference says 40"


def _profile(executor: str, broadcast: str, detach: str):
    from vllm_zerocopy_testbed.config import Executor, PatchMode
    from vllm_zerocopy_testbed.host_config import Profile

    return Profile(Executor(executor), PatchMode(broadcast), PatchMode(detach))


@pytest.mark.parametrize("profile, expected", [
    (("cgraph", "upstream", "upstream"), True), (("cgraph", "off", "off"), True),
    (("cgraph", "testbed", "testbed"), False), (("cgraph", "upstream", "testbed"), False),
    (("v2", "upstream", "upstream"), False), (("v2", "off", "off"), False)])
def test_the_cgraph_logprobs_failure_is_known_on_compiled_graphs_without_the_testbed_fix(profile, expected) -> None:
    assert (E2E["cgraph_logprobs"].reason_on(_profile(*profile)) is not None) is expected


def test_zero_copy_is_known_to_fail_only_with_the_broadcast_fix_off() -> None:
    known = E2E["zero_copy"]
    assert known.reason_on(_profile("v2", "off", "off")) and known.reason_on(_profile("v2", "off", "testbed"))
    assert known.reason_on(_profile("v2", "upstream", "off")) is None


@pytest.mark.parametrize("text", [CHANNEL_TIMEOUT, DIED_OF_TIMEOUT], ids=["the-timeout", "died-of-it"])
def test_the_channel_timeout_and_a_death_it_caused_match_the_cgraph_known_failure(text) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        pytest.fail(text, pytrace=False)
    assert E2E["cgraph_logprobs"].signature.mismatch(info.value, "") is None


@pytest.mark.parametrize("text", [WRONG_TOKENS, DIED_OF_SOMETHING_ELSE], ids=["wrong-tokens", "other-death"])
def test_a_bit_exact_regression_or_another_death_on_cgraph_upstream_is_red(text) -> None:
    """Deliberately different failures of a known-failing test: they must not pass as the compiled-graph deadlock."""
    with pytest.raises(pytest.fail.Exception) as info:
        pytest.fail(text, pytrace=False)
    why = E2E["cgraph_logprobs"].signature.mismatch(info.value, "")
    assert why and "does not match" in why


def test_the_zero_copy_signature_is_the_transport_checkers_words() -> None:
    from vllm_zerocopy_testbed.checker import transport

    from vllm_zerocopy_testbed.patches.wiretap import WIRE_PREFIX

    tensor = 2 << 20  # a 2 MiB tensor, sent in band: one frame a little larger than it
    in_band = transport.check_out_of_band(f"{WIRE_PREFIX} path=remote frames={tensor + 2848}", tensor, path="remote")
    assert E2E["zero_copy"].signature.mismatch(_raised(AssertionError(str(in_band))), "") is None
    nothing_sent = transport.check_out_of_band("", tensor, path="remote")  # the wire tap is gone: another failure
    assert E2E["zero_copy"].signature.mismatch(_raised(AssertionError(str(nothing_sent))), "")


def test_the_quoted_evidence_keeps_the_cause_when_tracebacks_flood_the_log() -> None:
    """The engine's death logs dozens of traceback lines after the channel timeout that caused it:
    the quote (the known failure's evidence) must still hold the timeout line."""
    from vllm_zerocopy_testbed.known import death_evidence

    log = "\n".join(["head-1 | INFO ready"] + [
        "head-1 | ERROR ray.exceptions.RayChannelTimeoutError: System error: Timed out waiting for object"] + [
        f"head-1 | ERROR Traceback line {i}: RuntimeError in engine" for i in range(60)])
    quoted = death_evidence(log, 3)
    assert "RayChannelTimeoutError" in quoted and "line 59" in quoted and "line 10:" not in quoted
    assert death_evidence("a\nb\nc", 2) == "b\nc", "no error line: the log's tail"
