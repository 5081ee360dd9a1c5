"""Checkers judge recorded histories: each must be able to fail."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.checker import bitexact, latency, timeouts, transport
from vllm_zerocopy_testbed.patches.wiretap import wire_line
from vllm_zerocopy_testbed.workload.requests import Record

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
    nudged = _record(lps=(-0.5, -1.2500001))
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


def test_latency_budget_is_relative_to_the_reference() -> None:
    reference = [_record(latency_s=0.1) for _ in range(5)]
    assert latency.check([_record(latency_s=1.0)] * 10, reference, factor=20).ok
    slow = latency.check([_record(latency_s=1.0)] * 9 + [_record(latency_s=60.0)] * 2, reference, factor=20)
    assert not slow.ok and slow.figures["budget_s"] == pytest.approx(2.0)


def test_transport_tells_out_of_band_from_in_band() -> None:
    tensor = 2100 * 512
    out_of_band = "\n".join(["noise", wire_line("remote", [900, tensor]), wire_line("overflow", [5000, tensor])])
    in_band = wire_line("remote", [tensor + 900])
    assert transport.check_out_of_band(out_of_band, tensor).ok
    assert not transport.check_out_of_band(in_band, tensor).ok
    assert not transport.check_out_of_band("", tensor).ok, "no tap lines is a failure, not a pass"
