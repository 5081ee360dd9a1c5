"""Pausing and stopping a process group we started (the reference server's, between its requests)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.cluster.process import pause_group, resume_group, stop_group

pytestmark = pytest.mark.unit


def _states(pgid: int) -> dict[int, str]:
    """Each live process of group ``pgid`` and its state letter (R, S, T = stopped, ...)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(entry.name)] = fields[0]
    return found


def _wait_states(pgid: int, want: set[str], count: int, within: float = 5.0) -> dict[int, str]:
    deadline = time.monotonic() + within
    while True:
        states = _states(pgid)
        if len(states) == count and set(states.values()) <= want:
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def test_the_whole_group_pauses_resumes_and_stops() -> None:
    # A parent and a child, as the API server and its engine core.
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        assert set(_wait_states(proc.pid, {"S", "R"}, 2).values()) <= {"S", "R"}
        assert pause_group(proc)
        states = _wait_states(proc.pid, {"T"}, 2)
        assert set(states.values()) == {"T"}, f"every process of the group stopped: {states}"
        assert resume_group(proc)
        states = _wait_states(proc.pid, {"S", "R"}, 2)
        assert "T" not in states.values(), f"every process of the group running again: {states}"
        pause_group(proc)
        resume_group(proc)  # stop_group's SIGTERM is acted on only once continued
        stop_group(proc, grace_s=5)
        assert proc.poll() is not None
        assert _wait_states(proc.pid, set(), 0) == {}, "the child went with the group"
    finally:
        stop_group(proc, grace_s=1)


def test_nothing_is_sent_to_a_process_that_ended() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait(timeout=10)
    assert not pause_group(proc) and not resume_group(proc) and not pause_group(None)
