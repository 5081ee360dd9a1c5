"""The version matrix's reading of pytest results and its table."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.matrix import VersionResult, _mode_counts, race_verdict, table

pytestmark = pytest.mark.unit

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.component.test_message_queue" name="test_zero_copy[off]">
  <skipped type="pytest.xfail" message="before PR 48442"/></testcase>
<testcase classname="tests.component.test_message_queue" name="test_zero_copy[upstream]"/>
<testcase classname="tests.component.test_message_queue" name="test_zero_copy[testbed]"/>
<testcase classname="tests.component.test_message_queue" name="test_race[remote-tensor-upstream]">
  <skipped type="pytest.xfail" message="PR 53217"/></testcase>
<testcase classname="tests.component.test_message_queue" name="test_race[remote-tensor-testbed]">
  <failure message="assert False"/></testcase>
<testcase classname="tests.component.test_ray_detach" name="test_bounded">
  <skipped type="pytest.skip" message="no"/></testcase>
</testsuite></testsuites>
"""


def test_outcomes_are_counted_per_mode_from_the_test_ids(tmp_path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    counts = _mode_counts(junit)
    assert counts["off"] == {"known-fail": 1}
    assert counts["upstream"] == {"passed": 1, "known-fail": 1}
    assert counts["testbed"] == {"passed": 1, "failed": 1}
    assert counts["any"] == {"skipped": 1}


def test_the_race_verdict_reads_the_upstream_race_tests(tmp_path) -> None:
    junit = tmp_path / "j.xml"
    race = JUNIT.replace("test_race", "test_mutating_after_enqueue_never_reaches_readers")
    junit.write_text(race)
    assert race_verdict(junit) == "tensors"
    arrays_only = race.replace('name="test_mutating_after_enqueue_never_reaches_readers[remote-tensor-upstream]">\n'
                               '  <skipped type="pytest.xfail" message="PR 53217"/></testcase>',
                               'name="test_mutating_after_enqueue_never_reaches_readers[remote-tensor-upstream]"/>\n'
                               '<testcase classname="t" name="test_mutating_after_enqueue_never_reaches_readers'
                               '[remote-ndarray-upstream]"><skipped type="pytest.xfail" message="x"/></testcase>')
    junit.write_text(arrays_only)
    assert race_verdict(junit) == "arrays"
    junit.write_text(JUNIT)
    assert race_verdict(junit) == "?"


def test_the_table_has_a_row_per_version_with_the_paths_present() -> None:
    rows = [VersionResult("0.34.0", True, True, False, False, "tensors, arrays", seconds=60.0,
                          modes={"off": {"passed": 3, "known-fail": 2}}),
            VersionResult("0.25.0", error="no overlay: no wheel of that release")]
    text = table(rows).splitlines()
    assert text[0].startswith("| vLLM code | tensor OOB (PR 48442) | detach (PR 35736) | compiled-graph executor | "
                              "53217 race: aliased (upstream) | off |")
    assert text[2].startswith("| 0.34.0 | yes | no | no | tensors, arrays | 3 passed, 2 known-fail |")
    assert "no overlay" in text[3]


def test_the_end_to_end_table_shows_the_race_suite_per_mode_and_why_a_release_did_not_run() -> None:
    from vllm_zerocopy_testbed.matrix import e2e_table

    rows = [VersionResult("0.33.0", True, e2e={
                "v2/upstream": {"structured": "known-fail", "smoke": "passed", "logprobs": "passed",
                                "arena": "skipped"},
                "v2/testbed": {"structured": "passed", "smoke": "passed", "logprobs": "failed", "arena": "skipped"},
                "all": {"arena": "passed", "across": "passed"}},
                e2e_seconds=900.0),
            VersionResult("0.34.0", True, e2e_note="no server: its CPU platform requires triton-cpu on x86")]
    text = e2e_table(rows).splitlines()
    assert text[0].startswith("| vLLM code | structured (53217 race): upstream | testbed |")
    assert text[2] == ("| 0.33.0 | known-fail | passed | 2 passed, 1 skipped | 1 failed, 1 passed, 1 skipped "
                       "(logprobs failed) | 2 passed | 15.0 |")
    assert text[3].startswith("| 0.34.0 | no server: its CPU platform requires triton-cpu on x86 |")



def test_a_run_past_its_bound_is_stopped_whole(tmp_path) -> None:
    """A real child that ignores SIGINT, with a grandchild: after the bound and the teardown grace
    nothing of its session is left, and the note says it ran past the bound."""
    import os
    import time

    from vllm_zerocopy_testbed.cluster.process import session_pids
    from vllm_zerocopy_testbed.matrix import run_bounded

    pid_file = tmp_path / "pid"
    cmd = ["sh", "-c", f"trap '' INT; echo $$ > {pid_file}; sleep 60 & wait"]
    start = time.monotonic()
    rc, note = run_bounded(cmd, tmp_path / "log", 1.0, env=dict(os.environ), teardown_s=1.0)
    assert time.monotonic() - start < 15
    assert rc is None and note.endswith("did not finish within 1 s")
    assert session_pids(int(pid_file.read_text())) == []
