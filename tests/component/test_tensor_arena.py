"""vLLM 0.32's shared-memory tensor arena across processes: bit-exact, private to each reader, and a
slot lifecycle that neither loses a tensor nor leaks a slot
(findings/arena-shared-slot, findings/arena-leaked-slots).

The writer is a real ``MessageQueue(enable_shm_tensor_arena=True)`` in this process, the readers
spawned processes attached through its handle (``harness/message_queue.py``), as vLLM's
multiprocessing executor has its workers. Slots are read from the writer's arena metadata
(``arena.slot_states``); what readers hold is checked on bytes.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from vllm_zerocopy_testbed.config import BROADCAST_ENV, PatchMode
from vllm_zerocopy_testbed.harness.message_queue import (MessageQueueHarness, QueueTopology, describe,
                                                         describe_item, view_of_view)
from vllm_zerocopy_testbed.waits import wait_until

pytestmark = [pytest.mark.component, pytest.mark.timeout(240), pytest.mark.needs_vllm("tensor arena")]

MiB = 1 << 20
SLOTS = 8  # vLLM's _ARENA_SLOTS
TWO_READERS = QueueTopology(local_readers=2, arena=True)

# Every dtype a CPU tensor can cross the queue in, 8 MiB each (the arena's lower limit).
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _tensor(nbytes: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        return raw > 127
    if dtype.is_floating_point and dtype.itemsize < 4:  # fp8/fp16/bf16: finite values, not raw bit patterns
        return (raw.view(torch.float32) if nbytes % 4 == 0 else raw.float()).nan_to_num().to(dtype)[: nbytes // dtype.itemsize]
    return raw.view(dtype)


@pytest.fixture
def harness_for(arena_mode: PatchMode):
    """``harness_for(topology, **kw)``: a harness with this arena mode; the broadcast mode is the
    run's (``TESTBED_BROADCAST``) or ``testbed``."""
    broadcast_mode = PatchMode.parse(os.environ.get(BROADCAST_ENV, "testbed"), variable=BROADCAST_ENV)

    def make(topology: QueueTopology = TWO_READERS, **kwargs) -> MessageQueueHarness:
        return MessageQueueHarness(topology, broadcast_mode, arena_mode=arena_mode, **kwargs)

    return make


def _count_arena_writes(harness: MessageQueueHarness) -> list[int]:
    """Count the slots the writer filled (``write_tensor`` returned a slot): one cell, updated in place."""
    tensor_arena = harness.writer.tensor_arena
    written = [0]
    installed = tensor_arena.write_tensor

    def write_tensor(tensor):
        slot = installed(tensor)
        written[0] += slot is not None
        return slot

    tensor_arena.write_tensor = write_tensor
    return written


def _lifecycle(arena_mode: PatchMode) -> None:
    """Slot lifecycle tests need an arena: ``off`` has none, and says so once
    (``test_tensors_at_the_limit_go_through_the_arena``, a strict known failure there)."""
    if arena_mode is PatchMode.OFF:
        pytest.skip("TESTBED_ARENA=off: no arena, no slots (test_tensors_at_the_limit_go_through_the_arena)")


def _assert_through_arena(written: list[int], want: int) -> None:
    assert written[0] == want, f"{written[0]} of {want} tensor(s) went through the arena"


def _held(harness: MessageQueueHarness) -> list[str]:
    return [state for state in harness.arena_slots() if state != "free"]


def test_readers_get_bit_exact_writable_tensors_at_every_size_and_dtype(harness_for) -> None:
    """8 MiB in every dtype, 64 MiB, and one tensor as large as a slot (256 MiB)."""
    payloads = [{str(d).removeprefix("torch."): _tensor(8 * MiB, d, seed=i) for i, d in enumerate(DTYPES[k:k + 5])}
                for k in range(0, len(DTYPES), 5)]
    payloads += [{"embeds": _tensor(64 * MiB).view(-1, 4096)}, {"slot": _tensor(256 * MiB, torch.bfloat16)}]
    with harness_for() as harness:
        for payload in payloads:
            expected = describe(payload)
            for rank, report in harness.broadcast(payload).items():
                assert report == expected, f"reader {rank} got different bytes or lost writability"


def test_tensors_at_the_limit_go_through_the_arena(harness_for, arena_mode, expect) -> None:
    expect("arena_used", arena_mode)
    with harness_for() as harness:
        written = _count_arena_writes(harness)
        harness.broadcast({"at": _tensor(8 * MiB), "below": _tensor(8 * MiB - 4)})
    _assert_through_arena(written, 1)


def test_a_reader_write_stays_its_own(harness_for, arena_mode, expect) -> None:
    """Reader 1 computes in place on what it received; reader 2's tensor must keep the writer's bytes."""
    expect("arena_reader_isolation", arena_mode)
    payload = {"x": _tensor(16 * MiB)}
    expected = describe(payload)["x"]
    with harness_for(keep=True) as harness:
        harness.broadcast(payload)
        harness.control("write", 0, rank=1)
        reports = harness.recheck()
    assert reports[2]["0/x"].digest == expected.digest, "reader 2 saw another reader's write"
    assert reports[1]["0/x"].digest != expected.digest, "reader 1's write did not take"


def test_a_reader_write_never_reaches_the_slots_next_message(harness_for, arena_mode) -> None:
    """Readers write what they received (one all of it, one every other page) and free it; 16 more
    messages then go through the slots (the testbed's writer takes the slots just freed): each
    reader must get the writer's bytes, never its own old ones (a private mapping kept per slot
    must drop the pages its reader wrote)."""
    _lifecycle(arena_mode)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        for index, (rank, action) in enumerate(((1, "write"), (2, "write-every-other-page"))):
            harness.broadcast({"x": _tensor(16 * MiB, seed=index)})
            harness.control(action, index, rank=rank)
            harness.control("drop", index)
        for index in range(2, 2 + 2 * SLOTS):
            payload = {"x": _tensor(16 * MiB, seed=index)}
            for rank, report in harness.broadcast(payload).items():
                assert report == describe(payload), f"reader {rank} got other bytes in message {index}"
            harness.control("drop", index)
    _assert_through_arena(written, 2 + 2 * SLOTS)


def test_the_testbed_writer_takes_the_slot_freed_last(harness_for, arena_mode) -> None:
    """Messages freed by every reader as they come: the testbed's writer alternates between the slots
    just freed, whose pages are still in the caches (vLLM's round robin writes all 8 in turn: an
    8 MiB slot write 1.38 ms against 0.78 ms alternating two, docs/design.md)."""
    if arena_mode is not PatchMode.TESTBED:
        pytest.skip("the testbed's slot choice; vLLM's is its round robin")
    with harness_for(keep=True) as harness:
        tensor_arena, used = harness.writer.tensor_arena, []
        installed = tensor_arena.write_tensor
        tensor_arena.write_tensor = lambda tensor: used.append(installed(tensor)) or used[-1]
        for index in range(2 * SLOTS):
            harness.broadcast({"x": _tensor(8 * MiB, seed=index)})
            harness.control("drop", index)
    assert None not in used and len(set(used)) <= 3, f"slots written in turn: {used}"


def test_tensors_held_across_many_later_messages_stay_intact(harness_for, arena_mode, expect) -> None:
    """The first message is kept while 3 x 8 later ones use and free every other slot."""
    _lifecycle(arena_mode)
    first = {"embeds": _tensor(16 * MiB, seed=99)}
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        harness.broadcast(first)
        for index in range(1, 3 * SLOTS + 1):
            harness.broadcast({"later": _tensor(8 * MiB, seed=index)})
            harness.control("drop", index)
        reports = harness.recheck()
    _assert_through_arena(written, 1 + 3 * SLOTS)
    for rank, report in reports.items():
        assert report["0/embeds"] == describe_item(first["embeds"]), f"reader {rank}'s held tensor changed"


def test_a_view_of_a_view_keeps_the_slot(harness_for, arena_mode) -> None:
    _lifecycle(arena_mode)
    tensor = _tensor(16 * MiB, seed=5)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        harness.broadcast({"x": tensor})
        _assert_through_arena(written, 1)
        harness.control("view-of-view", 0)  # the message's tensor is dropped, a view of a view kept
        harness.broadcast({"tick": torch.zeros(1)})  # each reader retires what it freed at its next dequeue
        assert _held(harness) == ["held by readers [0, 1]"], f"slots: {harness.arena_slots()}"
        reports = harness.recheck()
        harness.control("drop", 0)
        harness.broadcast({"tick": torch.zeros(1)})
        assert _held(harness) == [], f"the slot was not freed with the last view: {harness.arena_slots()}"
    for rank, report in reports.items():
        assert report["0/x"].digest == describe_item(view_of_view(tensor)).digest, f"reader {rank}'s view changed"


def test_a_full_arena_falls_back_without_loss(harness_for, arena_mode, expect, log_lines) -> None:
    """Ten tensors kept by every reader: eight fill the slots, two take the pickle path, none is lost.
    The first fallback logs vLLM's INFO line (then every 100th): one line for the two."""
    from vllm.distributed.device_communicators import shm_tensor_arena

    _lifecycle(arena_mode)
    payloads = [{"x": _tensor(8 * MiB, seed=i)} for i in range(SLOTS + 2)]
    logged = log_lines(shm_tensor_arena.logger)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        for payload in payloads:
            harness.broadcast(payload)
        _assert_through_arena(written, SLOTS)
        lines = [line for line in logged if "no free slot" in line]
        assert len(lines) == 1 and "1 fallbacks so far" in lines[0], (
            f"two fallbacks to the pickle path logged {lines}; expected the first's line alone")
        reports = harness.recheck()
        for index in range(len(payloads)):
            harness.control("drop", index)
        harness.broadcast({"x": _tensor(8 * MiB, seed=50)})  # the slots are free again
        _assert_through_arena(written, SLOTS + 1)
    for rank, report in reports.items():
        for index, payload in enumerate(payloads):
            assert report[f"{index}/x"] == describe_item(payload["x"]), f"reader {rank} lost message {index}"


def test_a_slot_is_reused_only_after_every_reader_freed_it(harness_for, arena_mode) -> None:
    _lifecycle(arena_mode)
    held = {"x": _tensor(16 * MiB, seed=1)}
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        harness.broadcast(held)
        harness.control("drop", 0, rank=1)  # reader 1 frees it, reader 2 keeps it
        for index in range(1, SLOTS + 1):  # eight more, kept: seven free slots, then the pickle path
            harness.broadcast({"x": _tensor(8 * MiB, seed=10 + index)})
        _assert_through_arena(written, SLOTS)
        assert "held by readers [1]" in harness.arena_slots(), f"slots: {harness.arena_slots()}"
        reports = harness.recheck()
    assert reports[2]["0/x"] == describe_item(held["x"]), "reader 2's tensor was overwritten: its slot was reused"


@pytest.mark.parametrize("keeper", [1, 2])
def test_a_slot_written_again_waits_for_every_reader_anew(harness_for, arena_mode, keeper) -> None:
    """A slot every reader freed is written again: each reader's done flag must be cleared, not only
    the first's. Every slot goes round once (all freed), then one tensor is kept by ``keeper`` and
    freed by the other reader while eight more are sent and kept: seven free slots, then the pickle
    path; the kept tensor's slot must not be reused."""
    _lifecycle(arena_mode)
    other = 3 - keeper
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        for index in range(SLOTS):
            harness.broadcast({"x": _tensor(8 * MiB, seed=300 + index)})
        harness.control("drop-all", 0)
        harness.broadcast({"tick": torch.zeros(1)})  # message SLOTS: the drops are retired at this read
        held = {"x": _tensor(16 * MiB, seed=400 + keeper)}
        harness.broadcast(held)  # message SLOTS + 1
        harness.control("drop", SLOTS + 1, rank=other)
        for index in range(SLOTS):
            harness.broadcast({"x": _tensor(8 * MiB, seed=500 + index)})
        reports = harness.recheck()
    assert reports[keeper][f"{SLOTS + 1}/x"] == describe_item(held["x"]), (
        f"reader {keeper}'s tensor was overwritten: its slot was reused once reader {other} freed it")
    _assert_through_arena(written, 2 * SLOTS)


def test_a_reader_that_dies_releases_nothing_it_held(harness_for, arena_mode, expect) -> None:
    """Reader 2 is killed holding a tensor; reader 1 frees its own: the slot stays taken (no reader
    can say the dead one is done), and the writer's next tensors go elsewhere."""
    _lifecycle(arena_mode)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        harness.broadcast({"x": _tensor(16 * MiB, seed=3)})
        harness.kill_reader(2)
        harness.control("drop", 0, rank=1, ranks={1})
        harness.send({"tick": torch.zeros(1)})
        harness.collect(ranks={1})
        _assert_through_arena(written, 1)
        assert _held(harness) == ["held by readers [1]"], f"slots: {harness.arena_slots()}"


def test_the_arena_leaves_nothing_in_dev_shm(harness_for, arena_mode) -> None:
    _lifecycle(arena_mode)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        harness.broadcast({"x": _tensor(8 * MiB)})  # readers exit holding it
        files = [harness.writer.tensor_arena.shared_memory.name, harness.writer.buffer.shared_memory.name]
    gc.collect()
    _assert_through_arena(written, 1)
    left = lambda: [name for name in files if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]  # noqa: E731
    try:
        wait_until("the arena's and the ring's files removed", lambda: not left(), timeout=10, poll_s=0.2)
    except TimeoutError:
        pass
    assert not left(), f"left in /dev/shm after shutdown: {left()}"


def test_mutating_the_source_after_enqueue_never_reaches_readers(harness_for, arena_mode, expect) -> None:
    """The arena copies once inside ``enqueue``: readers stopped while the writer reuses its tensor."""
    _lifecycle(arena_mode)
    source = _tensor(32 * MiB, seed=8)
    expected = describe_item(source)
    with harness_for() as harness:
        written = _count_arena_writes(harness)
        harness.pause_readers()
        resume = threading.Timer(3.0, harness.resume_readers)
        resume.start()
        try:
            harness.send({"x": source})
            source.fill_(255)
        finally:
            resume.cancel()
            harness.resume_readers()
        reports = harness.collect()
    _assert_through_arena(written, 1)
    for rank, report in reports.items():
        assert report["x"].digest == expected.digest, f"reader {rank} saw bytes written after enqueue"


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this member cannot be pickled")


def test_a_failed_enqueue_leaks_no_slot(harness_for, arena_mode, expect) -> None:
    """Two ways an ``enqueue`` fails after its tensor took a slot: a member that cannot be pickled,
    and the ring's timeout while the readers are stopped. Neither message reaches a reader."""
    expect("arena_failed_enqueue", arena_mode)
    with harness_for(QueueTopology(local_readers=1, arena=True)) as harness:
        for seed in range(3):
            with pytest.raises(TypeError, match="cannot be pickled"):
                harness.send({"x": _tensor(8 * MiB, seed=seed), "bad": _Unpicklable()})
        harness.pause_readers()
        try:
            chunks = harness.writer.buffer.max_chunks
            for _ in range(chunks):
                harness.send({"small": torch.zeros(4)})
            with pytest.raises(TimeoutError):
                harness.writer.enqueue({"x": _tensor(8 * MiB, seed=7)}, timeout=0.5)
        finally:
            harness.resume_readers()
        for _ in range(chunks):
            harness.collect()
        harness.broadcast({"tick": torch.zeros(1)})
        leaked = _held(harness)
    assert not leaked, f"{len(leaked)} slot(s) leaked by failed enqueues: {leaked}"


def test_many_frees_between_two_reads_release_every_slot(harness_for, arena_mode) -> None:
    """Readers keep a tensor in every slot, then free them all at once: their next read must hand
    every slot back (a scheduler drops a whole batch's inputs between two steps)."""
    _lifecycle(arena_mode)
    with harness_for(keep=True) as harness:
        written = _count_arena_writes(harness)
        for index in range(SLOTS):
            harness.broadcast({"x": _tensor(8 * MiB, seed=index)})
        _assert_through_arena(written, SLOTS)
        harness.control("drop-all", 0)
        harness.broadcast({"tick": torch.zeros(1)})
        assert _held(harness) == [], f"slots still taken after every tensor was freed: {harness.arena_slots()}"
        for index in range(SLOTS):
            harness.broadcast({"x": _tensor(8 * MiB, seed=100 + index)})
        _assert_through_arena(written, 2 * SLOTS)


def test_slots_freed_out_of_order_around_other_frees_all_come_back(harness_for, arena_mode) -> None:
    """A reader holds an early tensor while later ones are freed and retired, then frees it: that
    slot must come back too (its release was queued before the others were retired)."""
    _lifecycle(arena_mode)
    with harness_for(keep=True) as harness:
        for index in range(4):
            harness.broadcast({"x": _tensor(8 * MiB, seed=index)})
        for index in (2, 3, 0):  # each drop is retired at the reader's next read (the next control)
            harness.control("drop", index)
        harness.control("drop-all", 0)
        harness.broadcast({"tick": torch.zeros(1)})
        assert _held(harness) == [], f"a slot freed out of order never came back: {harness.arena_slots()}"


def test_a_writer_ahead_of_slow_readers_through_the_arena_loses_nothing(harness_for, arena_mode) -> None:
    """Three rounds of the slots sent back to back, one reader slow: a slot is rewritten only once
    both readers freed it, and every tensor arrives bit-exact whichever path it took."""
    sent = [{"x": _tensor(8 * MiB, seed=200 + index)} for index in range(3 * SLOTS)]
    with harness_for(delays={2: 0.03}) as harness:
        for payload in sent:
            harness.send(payload)
        for index, payload in enumerate(sent):
            for rank, report in harness.collect().items():
                assert report == describe(payload), f"reader {rank} read message {index} wrong"


def test_a_tensor_as_large_as_a_slot_takes_one_and_a_byte_more_does_not(harness_for, arena_mode) -> None:
    """The arena's upper limit from both sides: 256 MiB fills a slot, 256 MiB + 1 byte takes the
    pickle path (and still arrives)."""
    _lifecycle(arena_mode)
    slot = 256 * MiB
    with harness_for(QueueTopology(local_readers=1, arena=True)) as harness:
        written = _count_arena_writes(harness)
        for size in (slot, slot + 1):
            payload = {"x": _tensor(size, torch.uint8, seed=size % 7)}
            assert harness.broadcast(payload)[1] == describe(payload), f"a {size}-byte tensor arrived different"
            del payload
    _assert_through_arena(written, 1)
