"""The small-shm suite's pure half (tests/faults/small_shm.py): ring sizes, vLLM's check, the judgement."""

from __future__ import annotations

import pytest

from faults.small_shm import (MIB, Outcome, Segment, arena_bytes, first_error_line, first_refused, head_segments,
                              judge, names_shm_and_fix, ring_bytes, smallest_accepted)

pytestmark = pytest.mark.unit

VLLM_REFUSAL = ("(RayWorkerProc pid=412) RuntimeError: Insufficient space in /dev/shm for shared-memory allocation: "
                "240 MiB required, 44 MiB free. Increase /dev/shm (e.g. --shm-size or --ipc=host).")


def test_ring_and_arena_sizes_follow_vllm_layouts() -> None:
    assert ring_bytes(1, 24 * MIB) == 240 * MIB + 20  # a worker's response ring
    assert ring_bytes(2, 2 * MIB) == 20 * MIB + 30  # the broadcast ring at compose/.env's 2 MiB chunk
    assert arena_bytes(2) == 2048 * MIB + 24


def test_head_segments_put_the_arena_on_the_multiprocessing_executor_only() -> None:
    ray = head_segments(2, 2, executor="ray", arena=True)
    mp = head_segments(2, 2, executor="mp", arena=True)
    assert [s.name for s in ray] == ["broadcast ring", "TP group broadcaster", "response ring 0", "response ring 1"]
    assert ray[1].size == 24 * MIB + 12
    assert [s.name for s in mp][:2] == ["broadcast ring", "ShmTensorArena"]


@pytest.mark.parametrize(("size_mib", "reserved", "refused"), [
    (64, False, "response ring 0"),  # upstream PR 50606's report: 240 MiB required
    (64, True, "response ring 0"),
    (256, False, None),  # upstream: each check sees an almost empty /dev/shm
    (256, True, "response ring 0"),  # testbed: the broadcast ring's and the TP broadcaster's 44 MiB are taken first
    (512, True, "response ring 1"),
    (528, True, None),
])
def test_first_refused_follows_check_shm_free_space(size_mib: int, reserved: bool, refused: str | None) -> None:
    found = first_refused(size_mib * MIB, head_segments(2, 2), reserved=reserved)
    assert (found.name if found else None) == refused


def test_the_check_refuses_only_more_than_free() -> None:
    segment = Segment("ring", 100)
    assert first_refused(100, [segment], reserved=False) is None
    assert first_refused(99, [segment], reserved=False) == segment
    assert first_refused(150, [segment], reserved=False, used=51) == segment


def test_smallest_accepted_is_the_largest_ring_upstream_and_the_sum_under_testbed() -> None:
    segments = head_segments(2, 2)
    upstream, testbed = smallest_accepted(segments, reserved=False), smallest_accepted(segments, reserved=True)
    assert upstream == 240 * MIB + 20 and testbed == 524 * MIB + 82
    assert first_refused(upstream, segments, reserved=False) is None
    assert first_refused(upstream - 1, segments, reserved=False) is not None
    assert first_refused(testbed, segments, reserved=True) is None
    assert first_refused(testbed - 1, segments, reserved=True) is not None


def test_first_error_line_skips_prefixes_and_takes_the_first() -> None:
    logs = "\n".join(["head-1  | INFO starting", f"head-1  | {VLLM_REFUSAL}",
                      "head-1  | RuntimeError: Engine core initialization failed. See root cause above."])
    assert first_error_line(logs).startswith("RuntimeError: Insufficient space in /dev/shm")
    assert first_error_line("head-1 | Fatal Python error: Bus error") == "Fatal Python error: Bus error"
    assert first_error_line("all fine") == ""
    # the most telling kind first, whatever the order of the containers in compose's logs
    worker = "worker-1 | Exception: The current node timed out during startup."
    assert first_error_line(f"{worker}\nhead-1 | {VLLM_REFUSAL}").startswith("RuntimeError: Insufficient space")
    assert first_error_line(worker) == "Exception: The current node timed out during startup."
    assert first_error_line("head-1 | WARNING ... errors like `OSError: [Errno 24] Too many open files`") == ""


def test_a_refusal_is_green_only_when_it_names_shm_and_the_fix() -> None:
    assert names_shm_and_fix(first_error_line(VLLM_REFUSAL))
    ring_space = ("RingSpaceError: /dev/shm cannot hold a MessageQueue ring of 240 MiB (4 MiB free): its pages are "
                  "reserved when it is created, so that a /dev/shm filled later cannot SIGBUS the engine. "
                  "Increase /dev/shm (--shm-size)")
    assert judge(started=False, logs=ring_space).outcome is Outcome.REFUSED
    assert judge(started=False, logs=VLLM_REFUSAL).green
    unclear = judge(started=False, logs="RuntimeError: Engine core initialization failed. See root cause above.")
    assert unclear.outcome is Outcome.UNCLEAR and not unclear.green
    assert judge(started=False, logs="").outcome is Outcome.UNCLEAR


def test_after_a_start_only_equal_answers_are_green() -> None:
    assert judge(started=True, logs="", answered=True, bitexact=True).outcome is Outcome.SERVED
    assert judge(started=True, logs="", answered=True, bitexact=False).outcome is Outcome.WRONG
    assert judge(started=True, logs="", answered=False, bitexact=True).outcome is Outcome.CRASHED
    assert judge(started=True, logs="", answered=False, timed_out=True).outcome is Outcome.HUNG
    # answered, yet a process died of SIGBUS on the way: a crash
    crashed = judge(started=True, logs="worker-1 | Fatal Python error: Bus error", answered=True, bitexact=True)
    assert crashed.outcome is Outcome.CRASHED and crashed.first_error == "Fatal Python error: Bus error"
