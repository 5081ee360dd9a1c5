"""The one bounded wait: it ends at its deadline, early on an abort, and says what it waited for."""

from __future__ import annotations

import time

import pytest

from vllm_zerocopy_testbed.waits import WaitAborted, WaitTimeout, wait_until

pytestmark = pytest.mark.unit


def test_returns_what_ready_returned_as_soon_as_it_is_true() -> None:
    answers = iter([0, None, 3])
    assert wait_until("three", lambda: next(answers), timeout=5, poll_s=0.01) == 3


def test_ends_at_its_deadline_with_what_it_awaited_how_far_and_the_log_tail() -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as caught:
        wait_until("2 Ray nodes", lambda: False, timeout=0.3, poll_s=0.05, progress=lambda: "1 of 2 alive",
                   log_tail=lambda: "raylet: bind failed")
    assert 0.3 <= time.monotonic() - started < 2.0, "bounded: neither early nor late"
    text = str(caught.value)
    assert text.startswith("2 Ray nodes: not after 0 s (1 of 2 alive); waited 0.")
    assert text.endswith("--- last log lines ---\nraylet: bind failed")
    assert isinstance(caught.value, TimeoutError)


def test_a_zero_timeout_still_polls_once() -> None:
    assert wait_until("now", lambda: "yes", timeout=0) == "yes"


def test_an_abort_ends_the_wait_at_once_and_names_why() -> None:
    calls = []
    started = time.monotonic()
    with pytest.raises(WaitAborted, match=r"^API server /health: exited \(1\); waited"):
        wait_until("API server /health", lambda: calls.append(1), timeout=30,
                   abort=lambda: "exited (1)" if calls else None)
    assert time.monotonic() - started < 5 and len(calls) == 1


def test_a_long_wait_announces_what_it_is_at() -> None:
    lines: list[str] = []
    polls = iter(range(100))
    wait_until("head healthy", lambda: next(polls) >= 6, timeout=10, poll_s=0.05, announce=lines.append,
               announce_every_s=0.1, progress=lambda: "head starting")
    assert lines and all(line.startswith("head healthy: waiting, ") and line.endswith("of 10 s (head starting)")
                         for line in lines)
    quiet: list[str] = []
    wait_until("ready", lambda: True, timeout=10, announce=quiet.append, announce_every_s=0.1)
    assert quiet == []  # a wait that ends at once says nothing
