"""What a small /dev/shm does to a start (the small-shm suite's pure half): the segments vLLM puts in
the head's /dev/shm, which of them its free-space check refuses at a size, and the outcome's judgement.

vLLM checks the free space before it creates each ring (``check_shm_free_space``: refused when the
ring needs more bytes than are free), and tmpfs gives a page at its first write: upstream, a ring
costs ~nothing until written, so each check sees an almost empty /dev/shm. Under
``TESTBED_BROADCAST=testbed`` each ring's pages are reserved when it is created
(``patches/broadcast.py``: ``reserve_ring``), so every later check sees less.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

MIB = 1 << 20
RING_CHUNKS = 10  # MessageQueue's max_chunks
# worker_response_mq takes MessageQueue's signature default, whatever VLLM_MQ_MAX_CHUNK_BYTES_MB says
# (upstream PR 50606, open)
RESPONSE_CHUNK_BYTES = 24 * MIB
TP_CHUNK_BYTES, TP_CHUNKS = 4 * MIB, 6  # GroupCoordinator's mq_broadcaster
ARENA_SLOTS = 8  # vLLM's _ARENA_SLOTS
ARENA_SLOT_BYTES = 256 * MIB  # vLLM's _ARENA_SLOT_BYTES


def ring_bytes(n_local_readers: int, chunk_bytes: int, chunks: int = RING_CHUNKS) -> int:
    """The bytes of one ``ShmRingBuffer``: its chunks and one flag byte per chunk, writer and reader."""
    return (chunk_bytes + 1 + n_local_readers) * chunks


def arena_bytes(n_local_readers: int) -> int:
    """The bytes of one ``ShmTensorArena``: its slots and their flag bytes."""
    return (ARENA_SLOT_BYTES + 1 + n_local_readers) * ARENA_SLOTS


@dataclass(frozen=True)
class Segment:
    """One /dev/shm segment vLLM creates on the head at start, checked before it is created."""

    name: str
    size: int


def head_segments(local_ranks: int, chunk_mib: int, *, executor: str = "ray", arena: bool = False) -> list[Segment]:
    """The segments the head's vLLM creates, in order: the engine's broadcast ring to its ``local_ranks``
    (``VLLM_MQ_MAX_CHUNK_BYTES_MB`` chunks), the tensor arena beside it where vLLM enables one (the
    multiprocessing executor only: the Ray V2 executor does not pass ``--enable-shm-tensor-arena`` on),
    the TP group's broadcaster where its ranks share the node (``GroupCoordinator.mq_broadcaster``),
    then each local rank's response ring."""
    segments = [Segment("broadcast ring", ring_bytes(local_ranks, chunk_mib * MIB))]
    if arena and executor == "mp":
        segments.append(Segment("ShmTensorArena", arena_bytes(local_ranks)))
    if local_ranks > 1:
        segments.append(Segment("TP group broadcaster", ring_bytes(1, TP_CHUNK_BYTES, TP_CHUNKS)))
    segments += [Segment(f"response ring {rank}", ring_bytes(1, RESPONSE_CHUNK_BYTES)) for rank in range(local_ranks)]
    return segments


def first_refused(shm_bytes: int, segments: list[Segment], *, reserved: bool, used: int = 0) -> Segment | None:
    """The first segment vLLM's check refuses on a /dev/shm of ``shm_bytes`` with ``used`` already taken,
    or None. ``reserved``: each created segment takes its pages at once (``testbed``); otherwise none."""
    free = shm_bytes - used
    for segment in segments:
        if segment.size > free:
            return segment
        if reserved:
            free -= segment.size
    return None


def smallest_accepted(segments: list[Segment], *, reserved: bool, used: int = 0) -> int:
    """The smallest /dev/shm (bytes) on which no segment is refused."""
    if reserved:
        return used + sum(s.size for s in segments)
    return used + max(s.size for s in segments)


class Outcome(str, enum.Enum):
    """What a cluster with a small /dev/shm did."""

    SERVED = "served"  # healthy, every answer bit-exact to the reference
    REFUSED = "refused at start"  # did not start, and said why: /dev/shm and the fix
    UNCLEAR = "failed at start, unclear"  # did not start, no error naming /dev/shm and its fix
    WRONG = "served, answers differ"  # healthy but an answer differs from the reference
    CRASHED = "crashed mid-run"  # started, then died (SIGBUS, a failed request)
    HUNG = "hung mid-run"  # started, then a request outlived its bound


GREEN = (Outcome.SERVED, Outcome.REFUSED)

# The lines that say why a process died, best first: vLLM's check, the testbed's reservation, a SIGBUS,
# then any exception (compose's logs come container by container, not in time order).
_ERRORS = [re.compile(r"RuntimeError: Insufficient space in /dev/shm.*"), re.compile(r"RingSpaceError: .*"),
           re.compile(r"Fatal Python error: .*|\*\*\* SIGBUS received \*\*\*|\bBus error\b.*"),
           re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception)|Exception): .*")]
_FIX = re.compile(r"--shm-size|--ipc=host|shm_size")


def first_error_line(logs: str) -> str:
    """The first line of ``logs`` that says why something failed, of the most telling kind (``_ERRORS``:
    /dev/shm refused, a fatal signal, any exception), past its compose and process prefixes; "" for none."""
    # a warning that quotes an error it might cause (vLLM's ulimit one names OSError) is not one
    lines = [line for line in logs.splitlines() if "WARNING" not in line]
    for pattern in _ERRORS:
        for line in lines:
            found = pattern.search(line)
            if found:
                return found.group(0).strip()
    return ""


_REFUSED = re.compile(r"EngineCore failed to start|Insufficient space in /dev/shm|RingSpaceError")


def refused_at_start(logs: str) -> bool:
    """Whether the head's logs say its engine gave up starting (its restart would only say it again)."""
    return bool(_REFUSED.search(logs))


def names_shm_and_fix(line: str) -> bool:
    """Whether an error line names /dev/shm and a way to enlarge it (what a user can act on)."""
    return "/dev/shm" in line and bool(_FIX.search(line))


@dataclass(frozen=True)
class Judgement:
    """An outcome, its colour and the line that explains it."""

    outcome: Outcome
    first_error: str

    @property
    def green(self) -> bool:
        return self.outcome in GREEN


def judge(*, started: bool, logs: str, answered: bool | None = None, timed_out: bool = False,
          bitexact: bool | None = None) -> Judgement:
    """Judge one start. Not started: refused (green) when the first error names /dev/shm and its fix,
    else unclear (red). Started: a request past its bound is a hang, a failed one (or a fatal signal
    in the logs) a crash, a different answer wrong; all answered and equal is served (green)."""
    error = first_error_line(logs)
    if not started:
        return Judgement(Outcome.REFUSED if names_shm_and_fix(error) else Outcome.UNCLEAR, error)
    fatal = re.search(r"Fatal Python error|\bBus error\b|SIGBUS", logs)
    if timed_out:
        return Judgement(Outcome.HUNG, error)
    if not answered or fatal:
        return Judgement(Outcome.CRASHED, error)
    if not bitexact:
        return Judgement(Outcome.WRONG, error)
    return Judgement(Outcome.SERVED, error)
