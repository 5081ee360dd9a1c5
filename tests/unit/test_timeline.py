"""The out-of-band buffer timeline: events from real ZMQ sends, and the checker's figures.

Over ``inproc`` ZMQ hands a zero-copy message to the peer by reference, so the frame
stays held until the peer drops it: a write in between is the race of upstream PR 53217,
and the timeline must see it (negative gap, reader CRC differs); a send held until ZMQ
released the frame (the testbed's) must show none.
"""

from __future__ import annotations

import time

import pytest

from vllm_zerocopy_testbed.checker import timeline as checker
from vllm_zerocopy_testbed.patches import timeline
from vllm_zerocopy_testbed.patches.broadcast import _send, _wait_sent

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def lines(timeline_log):
    return timeline_log.messages


def _wait_for(lines: list[str], ev: str, count: int, timeout: float = 10.0) -> None:
    """Releases are logged from pyzmq's garbage-collector thread: wait for them, bounded."""
    deadline = time.monotonic() + timeout
    while sum(f'"ev":"{ev}"' in line for line in lines) < count:
        assert time.monotonic() < deadline, f"no {ev} event within {timeout} s: {lines}"
        time.sleep(0.01)


def _summary(lines: list[str]) -> dict[str, checker.KindFigures]:
    return checker.summarize(checker.events("\n".join(lines)))


def test_a_write_before_the_release_is_an_overlap_and_reaches_the_reader(pair, lines) -> None:
    """Upstream's send: the buffer is refilled while the peer still holds the message."""
    sender, receiver = pair
    buffer = bytearray(b"\x01" * 2 * MiB)
    frames = [b"stream", memoryview(buffer)]
    timeline._current.kind = "sample_tokens"
    timeline.on_send(sender, "remote", frames)
    sender.send_multipart(frames, copy=False)
    del frames
    timeline.on_write("grammar_bitmask", buffer, time.monotonic())
    buffer[:] = b"\x02" * len(buffer)  # the next step's fill
    received = receiver.recv_multipart(copy=False)
    timeline.on_recv(receiver, received)
    del received
    _wait_for(lines, "release", 1)
    figures = _summary(lines)["sample_tokens"].as_dict()
    assert figures["sent"] == figures["released"] == figures["received"] == 1
    assert figures["overlaps"] == 1 and figures["min_gap_ms"] < 0
    assert figures["corrupt"] == 1
    verdict = checker.check_no_overlap("\n".join(lines), need_kind="sample_tokens")
    assert not verdict.ok and "written again while ZMQ held them" in str(verdict)
    assert "reached a reader with other bytes" in str(verdict)


def test_a_send_held_until_released_shows_no_overlap(pair, lines) -> None:
    """The testbed's send: ``enqueue`` returns only after the release, so the refill comes after it."""
    sender, receiver = pair
    buffer = bytearray(b"\x01" * 2 * MiB)
    timeline._current.kind = "sample_tokens"
    original = sender.send_multipart

    def tapped(parts, **kwargs):  # what wiretap.install does to every MessageQueue socket
        timeline.on_send(sender, "remote", list(parts))
        return original(parts, **kwargs)

    sender.send_multipart = tapped
    releases = _send(sender, [b"stream", memoryview(buffer)], hold=True)
    received = receiver.recv_multipart(copy=False)
    timeline.on_recv(receiver, received)
    del received
    _wait_sent([("the peer", releases)], time.monotonic() + 10)
    _wait_for(lines, "release", 1)
    timeline.on_write("grammar_bitmask", buffer, time.monotonic())
    buffer[:] = b"\x02" * len(buffer)
    figures = _summary(lines)["sample_tokens"].as_dict()
    assert figures["released"] == 1 and figures["rewritten"] == 1
    assert figures["overlaps"] == 0 and figures["min_gap_ms"] >= 0
    assert figures["corrupt"] == 0
    assert checker.check_no_overlap("\n".join(lines), need_kind="sample_tokens").ok


def test_small_frames_and_messages_are_not_logged(pair, lines) -> None:
    sender, _ = pair
    timeline.on_send(sender, "remote", [b"stream", memoryview(bytearray(MiB - 1))])
    assert lines == []


def _event(ev: str, t: float, *, seq: int = 0, addr: int = 1000, nbytes: int = MiB, **extra) -> dict:
    return {"ev": ev, "pid": 1, "port": 5, "seq": seq, "frame": 1, "addr": addr, "nbytes": nbytes, "t": t,
            "kind": "sample_tokens", "crc": 7, **extra}


def test_the_gap_is_taken_to_the_first_write_into_the_same_memory() -> None:
    found = [
        _event("send", 1.0), _event("release", 1.002),
        _event("write", 1.010, addr=5_000_000),  # other memory: not a rewrite
        _event("write", 1.005, addr=1000 + MiB - 1, nbytes=10),  # overlaps the last byte
        _event("send", 1.020, seq=1, crc=8),  # the same memory sent again, never released
    ]
    figures = checker.summarize(found)["sample_tokens"].as_dict()
    assert figures["sent"] == 2 and figures["released"] == 1
    assert figures["min_gap_ms"] == pytest.approx(3.0)
    assert figures["overlaps"] == 0


def test_one_message_on_two_sockets_is_no_rewrite() -> None:
    """Past the ring chunk a message goes to local readers (overflow socket) and remote ones:
    the same unchanged memory handed over twice, the first released after the second send."""
    found = [
        {**_event("send", 1.000), "port": 0}, _event("send", 1.001), _event("release", 1.004),
        {**_event("release", 1.005), "port": 0},
    ]
    assert checker.summarize(found)["sample_tokens"].overlaps == 0
    changed = [*found[:1], _event("send", 1.001, crc=9), *found[2:]]  # other bytes: written in between
    assert checker.summarize(changed)["sample_tokens"].overlaps == 1


def test_a_frame_rewritten_and_never_released_is_an_overlap() -> None:
    found = [_event("send", 1.0), _event("write", 1.001)]
    assert checker.summarize(found)["sample_tokens"].overlaps == 1


def test_the_checker_fails_when_the_path_was_never_reached() -> None:
    verdict = checker.check_no_overlap("no timeline here", need_kind="sample_tokens")
    assert not verdict.ok and "no out-of-band sample_tokens frame" in str(verdict)


def test_events_survive_log_prefixes_and_ignore_cut_lines() -> None:
    logs = ('head-1  | INFO 12-01 10:00:00 [testbed] mq-timeline {"ev":"write","pid":1,"kind":"k","addr":1,'
            '"nbytes":2,"t":3.0}\n(RayWorkerProc pid=9) INFO [testbed] mq-timeline {"ev":"recv",\n')
    assert checker.events(logs) == [{"ev": "write", "pid": 1, "kind": "k", "addr": 1, "nbytes": 2, "t": 3.0}]


def test_a_report_line_names_every_figure() -> None:
    found = [_event("send", 1.0), _event("release", 1.004), _event("write", 1.002)]
    line = checker.describe(checker.summarize(found)["sample_tokens"])
    assert line.startswith("sample_tokens: 1 out-of-band frames") and "1 written while held" in line


def test_a_scheduled_batch_is_logged_and_left_out_of_the_figures(lines) -> None:
    """``schedule`` events (one per batch the scheduler formed) say when fills follow sends; they
    carry no memory, so the figures ignore them."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    output = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={"a": 1, "b": 4}, total_num_scheduled_tokens=5,
                             scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                             num_common_prefix_blocks=[], finished_req_ids=set(), free_encoder_mm_hashes=[])
    timeline.on_schedule(output)
    timeline.on_write("grammar_bitmask", bytearray(2 * MiB), time.monotonic(), rows=3)
    found = checker.events("\n".join(lines))
    assert [(e["ev"], e.get("tokens"), e.get("reqs"), e.get("rows")) for e in found] == [
        ("schedule", 5, 2, None), ("write", None, None, 3)]
    assert _summary(lines) == {}


def test_the_path_figures_add_up_each_message_and_count_what_zmq_kept(pair, lines) -> None:
    sender, receiver = pair
    for sizes in ((2, 3), (1,)):
        frames = [b"m", *(memoryview(bytearray(n * MiB)) for n in sizes)]
        timeline.on_send(sender, "remote", frames)
        sender.send_multipart(frames, copy=False)
        receiver.recv_multipart()  # a copy: ZMQ lets go of the frames
        del frames
    _wait_for(lines, "release", 3)
    kept = [b"c", memoryview(bytearray(1 * MiB))]
    timeline.on_send(sender, "remote", kept)  # handed over, never sent: not released
    timeline.on_send(sender, "overflow", [b"d", bytearray(8 * MiB)])  # a local reader's path: not counted
    logs = "\n".join(f"(EngineCore pid=1) INFO [testbed] {line}" for line in lines)
    figures = checker.path_figures(logs)
    assert figures["largest_bytes"] == 5 * MiB and figures["frames"] == 4 and figures["unreleased"] == 1
    assert figures["held_ms_max"] >= 0
    assert checker.path_figures(logs, path="overflow")["largest_bytes"] == 8 * MiB
    assert checker.path_figures("no timeline here")["largest_bytes"] == 0
