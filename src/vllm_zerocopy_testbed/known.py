"""Known failures as data: where a property fails, why, and what that failure looks like.

A known failure is expected only as itself, so that a new failure cannot hide behind it: each
names the exception it raises and a pattern its text must contain (an assertion's words, a
checker's problem line, a server-log line quoted in the failure). A failure of a known-failing
test that does not match is a new failure, and red. The test layers read the table
(``tests/conftest.py``: unit and component tests, by mode; ``tests/e2e``: by profile)
and enforce the match after pytest's own xfail handling; nothing here imports pytest.

Each reason says what fails, then the folder under ``findings/`` that documents it (its
``REPORT.md``, with a standalone repro and the fix) and the upstream thread; a failure no
finding documents says in words what fails and where upstream fixed it. Reports group the
known failures of a run by that folder (``finding_of``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm_zerocopy_testbed.config import ARENA_ENV, BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV

# The findings' folders the reasons name (``findings/<name>/REPORT.md``).
SEND_RACE = "findings/53217-oob-send-race"
RAYLET_DEADLOCK = "findings/cgraph-raylet-writeacquire"
ARENA_SHARED_SLOT = "findings/arena-shared-slot"
ARENA_LEAKED_SLOTS = "findings/arena-leaked-slots"
SAMPLING_MASKS = "findings/detach-sampling-masks"
_FINDING = re.compile(r"\bfindings/([\w.-]+)")


def finding_of(text: str) -> str | None:
    """Return the folder (``findings/<name>``) a known failure's text names first, or None."""
    match = _FINDING.search(text)
    return f"findings/{match.group(1)}" if match else None


# pytest.fail() raises _pytest.outcomes.Failed; matched by name, so this module needs no pytest.
ASSERTION = ("AssertionError", "Failed")


@dataclass(frozen=True)
class Signature:
    """What a known failure looks like: one of ``exceptions`` (class names, base classes
    included), with ``pattern`` found in its text."""

    pattern: str
    exceptions: tuple[str, ...] = ASSERTION
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern, re.DOTALL))

    def mismatch(self, exc: BaseException, text: str) -> str | None:
        """Return why ``exc`` (with its report ``text``) is not this failure, or None when it is."""
        names = {cls.__name__ for cls in type(exc).__mro__}
        if not names & set(self.exceptions):
            return f"raised {type(exc).__name__}, the known failure raises {' or '.join(self.exceptions)}"
        if not self._compiled.search(f"{exc}\n{text}"):
            return f"its text does not match the known failure's /{self.pattern}/"
        return None


@dataclass(frozen=True)
class Known:
    """One property's known failures: ``reasons`` per mode (the property's mode switch is
    ``env``), and the signature every one of them must match."""

    env: str
    reasons: dict[str, str]
    signature: Signature
    # The upstream reason holds only where the vLLM code has this path (vllm_source's names):
    # before it, upstream behaves as the pre-fix code and the property must hold (or fail as ``off``).
    upstream_needs: str = ""


def _known(env: str, reasons: dict[str, str], pattern: str, upstream_needs: str = "") -> Known:
    return Known(env, reasons, Signature(pattern), upstream_needs)


# An array still backed by a compiled-graph channel: read in place (unit), or the next read
# stalls until the channel's timeout (component, real Ray).
_HELD = (r"still backed by the channel|ended with RayChannelTimeoutError after [\d.]+ s while earlier outputs "
         r"were held")

# Unit and component tests: property -> its known failures (``expect(prop, mode)`` in a test).
COMPONENT: dict[str, Known] = {
    "zero_copy": _known(
        BROADCAST_ENV, {"off": "zero copy: torch's reducer copies tensors into the pickle stream (fixed upstream "
                               "by PR 48442)"},
        r"no frame carries the tensor's bytes|the pickle stream still holds the tensor"),
    "fp8_transport": _known(
        BROADCAST_ENV, {"off": "fp8 transport: torch's reducer cannot load back the fp8 tensors it pickles"},
        r"read_error.*UntypedStorage' has no attribute 'dtype'"),
    "race_free_tensor": _known(
        BROADCAST_ENV, {"upstream": f"send race: ZMQ frames alias the live tensor ({SEND_RACE}, upstream PR 53217)"},
        r"saw bytes written after enqueue",
        # before PR 48442 (0.26.0) torch's reducer copies tensors into the pickle stream: no alias
        upstream_needs="tensors out of band"),
    "race_free_ndarray": _known(
        BROADCAST_ENV, {"upstream": f"send race: ZMQ frames alias the live array ({SEND_RACE}, upstream PR 53217)",
                        "off": f"send race: numpy buffers >= 1 MiB go to ZMQ with copy=False in every release "
                               f"({SEND_RACE}, upstream PR 53217)"},
        r"saw bytes written after enqueue|got batch B's masks in batch A's sample_tokens"),
    "detach_logprobs": _known(
        DETACH_ENV, {"off": "held outputs: channel-backed logprobs arrays are kept and stall the next read "
                            "(vLLM#35319, fixed upstream by PR 35736)"}, _HELD),
    "cgraph_no_deadlock": _known(
        INFLIGHT_ENV, {"off": f"compiled-graph deadlock: two executions in flight (PP=2) and two output channels "
                            f"(TP=2) deadlock the driver node's raylet ({RAYLET_DEADLOCK})",
                     "upstream": f"compiled-graph deadlock: vLLM keeps PP executions in flight and the driver node's "
                                 f"raylet deadlocks ({RAYLET_DEADLOCK})"},
        r"DEADLOCK: .*RayChannelTimeoutError"),
    "ring_reserved": _known(
        BROADCAST_ENV, {"upstream": "sparse ring: vLLM creates its MessageQueue ring sparse (tmpfs places a page at "
                                    "its first write: SIGBUS once /dev/shm is full)",
                        "off": "sparse ring: vLLM creates its MessageQueue ring sparse"},
        r"the ring is sparse"),
    "arena_used": _known(
        ARENA_ENV, {"off": "no arena: before vLLM 0.32 tensors >= 8 MiB take the pickle path"},
        r"went through the arena"),
    "arena_reader_isolation": _known(
        ARENA_ENV, {"upstream": f"shared arena slot: vLLM 0.32's readers all view the same slot, one reader's write "
                                f"is every reader's ({ARENA_SHARED_SLOT})"},
        r"saw another reader's write"),
    "arena_failed_enqueue": _known(
        ARENA_ENV, {"upstream": f"leaked arena slots: vLLM 0.32 claims a slot while pickling, and an enqueue that "
                                f"then fails publishes nothing and never frees it ({ARENA_LEAKED_SLOTS})"},
        r"slot\(s\) leaked by failed enqueues"),
    "detach_sampling_mask": _known(
        DETACH_ENV, {"off": "held outputs: channel-backed arrays are kept and stall the next read (vLLM#35319, "
                            "fixed upstream by PR 35736)",
                     "upstream": f"sampling masks held: upstream's detach copies logprobs and aux rows only, not "
                                 f"sampling_masks ({SAMPLING_MASKS})"},
        _HELD),
    "single_consumer_dequeue": _known(
        BROADCAST_ENV, {"upstream": "concurrent dequeue: acquire_read binds the reader's ring slot once, so one of two "
                                    "threads of a reader stays on a slot the other read, then reads the other's slot: "
                                    "messages lost or read twice, the writer blocked (upstream vLLM report 50398; its "
                                    "lock, upstream PR 50423, closed unmerged)",
                        "off": "concurrent dequeue: vLLM's dequeue is single-consumer per reader object, and only "
                               "the testbed's mode serializes it (upstream vLLM report 50398)"},
        r"two threads dequeuing from one MessageQueue got"),
    "remote_port_bound_at_pick": _known(
        BROADCAST_ENV, {"upstream": "port race: MessageQueue picks its remote port with get_open_port() and binds it "
                                    "later, so another socket can take it in between and the start fails (upstream "
                                    "vLLM report 50960, fixed from 0.28.0: bind :0, read LAST_ENDPOINT)"},
        r"MessageQueue could not bind the remote port it picked.*Address already in use"),
}


@dataclass(frozen=True)
class KnownOnProfiles:
    """An e2e property's known failure: on which profiles (executor and modes; empty: any), why,
    and its signature (the failing checker's words, or the server-log evidence quoted with them)."""

    reason: str
    signature: Signature
    executors: frozenset[str] = frozenset()
    broadcast: frozenset[str] = frozenset()
    detach: frozenset[str] = frozenset()

    def reason_on(self, profile: Any) -> str | None:
        """Return why ``profile`` (a ``config.Profile``) is known to fail, or None where it must pass."""
        for allowed, value in ((self.executors, profile.executor), (self.broadcast, profile.broadcast),
                               (self.detach, profile.detach)):
            if allowed and value.value not in allowed:
                return None
        return self.reason


# e2e tests (``@pytest.mark.known(property)``): property -> where it fails and what that looks like.
E2E: dict[str, KnownOnProfiles] = {
    "zero_copy": KnownOnProfiles(
        "zero copy: torch's reducer copies the tensor into the pickle stream (fixed upstream by PR 48442)",
        Signature(r"no frame carries the \d+-byte tensor out of band"), broadcast=frozenset({"off"})),
    # The engine's death is quoted with its server-log cause (``LiveCluster.dead``), so the tests
    # after the first logprobs request match only if that cause is the channel timeout too.
    "cgraph_logprobs": KnownOnProfiles(
        f"compiled-graph deadlock: the first logprobs request deadlocks the driver node's raylet (zero-copy "
        f"outputs, two executions in flight, one output channel per TP rank) until RAY_CGRAPH_get_timeout, and "
        f"the engine dies ({RAYLET_DEADLOCK}; the testbed's fix: one execution in flight, patches/inflight.py, "
        f"which e2e profiles turn on with their detach mode)",
        Signature(r"RayChannelTimeoutError|WriteAcquire"), executors=frozenset({"cgraph"}),
        detach=frozenset({"off", "upstream"})),
    "ring_reserved": KnownOnProfiles(
        "sparse ring: vLLM creates its MessageQueue ring sparse and checks /dev/shm's free space only then: "
        "filled later, the engine's next write to a new ring page is SIGBUS (the testbed reserves the pages at "
        "creation)",
        Signature(r"Fatal Python error: Bus error"), broadcast=frozenset({"upstream", "off"})),
}


def judge_report(report: Any, exc: BaseException | None, signature: Signature | None) -> None:
    """Turn an expected failure (pytest's ``xfailed`` report) back into a failure where it does not
    match ``signature``; called from a ``pytest_runtest_makereport`` wrapper after pytest's own."""
    if signature is None or exc is None or not report.skipped or not hasattr(report, "wasxfail"):
        return
    why = signature.mismatch(exc, report.longreprtext)
    if why:
        report.outcome = "failed"
        del report.wasxfail
        report.sections.append(("known failure", f"not the known failure ({why}): a new failure is red"))


# Server-log words that name why an engine died, first occurrence quoted first (``death_evidence``).
CAUSES = ("RayChannelTimeoutError", "WriteAcquire", "check failed", "EngineDeadError")
_ERROR_WORDS = ("RayChannelTimeoutError", "EngineDeadError", "died", "Traceback", "Error", "check failed")


def death_evidence(logs: str, lines: int = 30) -> str:
    """Return the server log lines that say why requests failed: the first line of each cause
    (a channel timeout, a raylet check, a dead engine), then the latest error lines; else the tail.

    A death floods the log with tracebacks: its cause must not scroll out of the window, since
    a known failure (``E2E``) matches the tests after it only by that quoted cause."""
    all_lines = logs.splitlines()
    hits = [line for line in all_lines if any(word in line for word in _ERROR_WORDS)]
    causes = [next(line for line in hits if cause in line) for cause in CAUSES if any(cause in h for h in hits)]
    tail = [line for line in hits[-lines:] if line not in causes]
    return "\n".join(causes + tail) or "\n".join(all_lines[-lines:])
