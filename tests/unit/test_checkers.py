"""Checkers judge recorded histories: each must be able to fail."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.checker import bitexact, latency, timeouts, transport
from vllm_zerocopy_testbed.patches.wiretap import wire_line
from vllm_zerocopy_testbed.workload.requests import Event, Record

pytestmark = pytest.mark.unit


def _record(key: str = "k", latency_s: float = 1.0, status: str = "ok", tokens=(1, 2), lps=(-0.5, -1.25),
            **extra) -> Record:
    choice = {"text": "ab", "tokens": list(tokens), "token_logprobs": list(lps),
              "top_logprobs": [{str(t): lp} for t, lp in zip(tokens, lps)], **extra}
    return Record(key=key, suite="s", profile="p", bound_s=10.0, latency_s=latency_s, status=status,
                  choices=[choice] if status == "ok" else [])


def test_timeouts_names_hangs_errors_and_late_answers() -> None:
    verdict = timeouts.check([_record("a"), _record("b", status="timeout"), _record("c", latency_s=11.0),
                              Record(key="d", suite="s", profile="p", bound_s=10, status="error", http_status=500,
                                     error="EngineDeadError")])
    assert not verdict.ok
    text = str(verdict)
    assert "b: HANG" in text and "c: answered after 11.0 s" in text and "d: HTTP 500" in text
    assert timeouts.check([_record()]).ok
    assert not timeouts.check([]).ok, "an empty history proves nothing"


def test_bit_exact_sees_one_ulp_and_a_different_token() -> None:
    base = _record()
    assert bitexact.differences(base, _record()) == []
    nudged = _record(lps=(-0.5, -1.25 - 1e-7))
    assert bitexact.differences(base, nudged), "a logprob one ulp off must differ at tolerance 0"
    assert bitexact.differences(base, nudged, tolerance=1e-5) == []
    assert bitexact.differences(base, _record(tokens=(1, 3)), tolerance=1.0)


def test_bit_exact_compares_prompt_logprobs_and_text_without_logprobs() -> None:
    a = _record(prompt_logprobs=[None, {"7": {"logprob": -2.0, "rank": 1}}])
    b = _record(prompt_logprobs=[None, {"7": {"logprob": -2.5, "rank": 1}}])
    assert bitexact.differences(a, b)
    plain_a = Record(key="p", suite="s", profile="p", bound_s=1, choices=[{"text": "hello"}])
    plain_b = Record(key="p", suite="s", profile="p", bound_s=1, choices=[{"text": "help"}])
    assert bitexact.differences(plain_a, plain_b)


def test_bit_exact_check_fails_with_nothing_to_compare() -> None:
    assert not bitexact.check([_record("x")], {}).ok
    assert bitexact.check([_record("x")], {"x": _record("x")}).ok


def test_across_profiles_needs_a_request_in_common_and_sees_one_token() -> None:
    same = {"v2/testbed": {"k": _record()}, "v2/upstream": {"k": _record()}}
    assert bitexact.across(same).ok and bitexact.across(same).figures == {"v2/testbed vs v2/upstream": 1}
    differs = {"v2/testbed": {"k": _record()}, "v2/upstream": {"k": _record(tokens=(1, 3))}}
    assert "v2/testbed vs v2/upstream, k:" in str(bitexact.across(differs))
    disjoint = {"v2/testbed": {"a": _record("a")}, "cgraph/upstream": {"b": _record("b")}}
    verdict = bitexact.across(disjoint)
    assert not verdict.ok and "nothing compared" in str(verdict)


def _pairs(cluster_s: list[float], reference_s: list[float]) -> list[Record]:
    return [Record(key=f"k{i}", suite="s", profile="p", bound_s=120.0, latency_s=c, reference_latency_s=r)
            for i, (c, r) in enumerate(zip(cluster_s, reference_s))]


def test_latency_judges_pairs_so_uniform_load_passes_and_a_slower_cluster_fails() -> None:
    reference = [0.1, 0.2, 0.1, 0.4, 0.1, 0.2, 0.1, 0.4] * 3
    healthy = [10 * r * (1 + 0.1 * (i % 3)) for i, r in enumerate(reference)]
    assert latency.check(_pairs(healthy, reference), budget=20).ok
    # A CPU hog slows both sides of every pair: the ratios stay, the verdict too.
    hogged = latency.check(_pairs([3 * c for c in healthy], [3 * r for r in reference]), budget=20)
    assert hogged.ok and hogged.figures["ratio_p50"] == pytest.approx(11, rel=0.01)
    # The same cluster 2x slower beside the same reference: the median ratio doubles past the budget.
    slow = latency.check(_pairs([2 * c for c in healthy], reference), budget=20)
    assert not slow.ok and "22.0x slower than the reference" in str(slow)
    # Measured without the reference beside it: nothing to measure is a failure, not a pass.
    alone = [Record(key="k", suite="s", profile="p", bound_s=9, latency_s=1.0)]
    assert "nothing to measure" in str(latency.check(alone, budget=20))


def test_latency_names_one_stalled_request_among_healthy_ones() -> None:
    reference = [0.1, 0.2, 0.1, 0.4, 0.05] * 4
    cluster = [1.5 + 0.5 * r for r in reference]  # a fixed cost per request, as the cluster has
    cluster[6] += 8.0  # k6: 9.6 s where 1.6 s was due
    verdict = latency.check(_pairs(cluster, reference), budget=40)
    assert not verdict.ok and len(verdict.problems) == 1, verdict
    assert verdict.problems[0].startswith("k6 stalled: 9.60 s where the run predicts 1.60 s")
    assert verdict.figures["fit_intercept_s"] == pytest.approx(1.5) and verdict.figures["fit_slope"] == pytest.approx(0.5)
    # 3x its due time is noise under load, not a stall; nor is +1.5 s on a short request.
    cluster = [1.5 + 0.5 * r for r in reference]
    cluster[6], cluster[4] = 3 * 1.6, 1.525 + 1.5
    assert latency.check(_pairs(cluster, reference), budget=40).ok


def test_transport_tells_out_of_band_from_in_band() -> None:
    tensor = 2100 * 512
    out_of_band = "\n".join(["noise", wire_line("remote", [900, tensor]), wire_line("overflow", [5000, tensor])])
    in_band = wire_line("remote", [tensor + 900])
    assert transport.check_out_of_band(out_of_band, tensor).ok
    assert not transport.check_out_of_band(in_band, tensor).ok
    assert not transport.check_out_of_band("", tensor).ok, "no tap lines is a failure, not a pass"


def test_fault_bound_counts_in_flight_and_later_requests_from_the_fault() -> None:
    from vllm_zerocopy_testbed.checker import faults

    def rec(key: str, started: float, latency: float, status: str = "ok") -> Record:
        return Record(key=key, suite="s", profile="p", bound_s=120.0, started=started, latency_s=latency,
                      status=status)

    fault = [Event(1000.0, "kill-worker-node", "apply", "worker", "p"), Event(1045.0, "kill-worker-node", "heal", "worker", "p")]
    records = [rec("done-before", 990.0, 5.0),  # ended before the fault: not affected
               rec("in-flight", 998.0, 30.0, "error"),  # ended 28 s after the fault
               rec("later", 1010.0, 2.0, "error"),
               rec("answered", 1020.0, 1.0)]
    verdict = faults.check(records, fault, bound_s=60.0)
    assert verdict.ok, verdict
    assert verdict.figures["requests"] == 3 and verdict.figures["failed"] == 2
    assert verdict.figures["first_error_s"] == 12.0 and verdict.figures["last_end_s"] == 28.0
    late = faults.check([rec("hung", 999.0, 119.0, "timeout")], fault, bound_s=60.0)
    assert not late.ok and "hung" in late.problems[0]
    assert not faults.check([rec("done-before", 990.0, 5.0)], fault, 60.0).ok, "no request covered the fault"
    assert not faults.check(records, fault[1:], 60.0).ok, "a history without the fault proves nothing"
    broken = faults.check(records, [*fault, Event(1001.0, "kill-worker-node", "failed", "worker", "p", "boom")], 60.0)
    assert not broken.ok and "boom" in str(broken), "a nemesis that failed is no fault run"


def test_the_faults_table_says_how_each_nemesis_ended() -> None:
    from vllm_zerocopy_testbed.report import faults_table

    row = {"nemesis": "kill-worker-node", "bound_s": 60.0, "requests": 5, "failed": 3, "first_error_s": 12.3,
           "last_end_s": 14.0, "within_bound": True, "unhealthy_after_s": 13.1, "recovered": "make up",
           "recovery_s": 170.2, "bit_exact_after": True, "profile": "v2/testbed"}
    line = faults_table([row, {**row, "nemesis": "pause", "within_bound": False, "unhealthy_after_s": None,
                               "first_error_s": -1.0, "note": "largest step 16.0 MiB"}]).splitlines()
    assert line[2] == ("| kill-worker-node | v2/testbed | 60 s | 5 (3) | 12.3 s | 14.0 s | 13.1 s | make up in 170 s "
                       "| yes |")
    assert "**over bound**" in line[3] and "stayed 200" in line[3] and "| none |" in line[3]
    assert line[-1] == "- pause (v2/testbed): largest step 16.0 MiB", "a row's note goes below the table"
