"""Nemeses: what goes wrong on purpose, on any ``Cluster`` backend, while a workload runs.

A nemesis is data: a name, what it does, the node it targets, and two steps over the
``Cluster`` interface: ``apply`` at the fault time and ``heal`` after the hold (what an
operator would undo: resume, rejoin). ``run`` is the schedule: the workload streams, the
nemesis applies after ``lead_s``, holds ``hold_s`` and heals; each step is an ``Event`` in
the same ``History`` as the requests, so checkers read the fault time from data.
Recovery itself is the cluster's job (restart policies, the head's watchdog) or
``cluster.up()``'s (``recovery.recover``).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Callable

from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.workload.requests import Event, History
from vllm_zerocopy_testbed.workload.stream import Stream

# Longer than Ray's node-death detection and the watchdog's grace: the fault is a loss, not a blip.
HOLD_S = 45.0
# The promise the fault checker holds every request to: it ends within this of a node loss.
BOUND_S = 60.0
RAY_WORKER_ACTOR = "ray::RayWorker"  # RayWorkerProc (V2) or RayWorkerWrapper (compiled graph)


@dataclass(frozen=True)
class Nemesis:
    name: str
    what: str
    target: str
    apply: Callable[[Cluster, str], None]
    heal: Callable[[Cluster, str], None] = lambda cluster, node: None
    needs: tuple[str, ...] = ()  # the Cluster operations it calls
    # What streams beside it: "mixed" (logprobs and a 1 MiB prompt_embeds request) or "large"
    # (batches of prompt_embeds whose one scheduler step is >= 16 MiB: past the socket buffers).
    workload: str = "mixed"
    # Its nodes stay up and it ends within the bound: no request may fail (a gray failure or
    # a full /dev/shm must cost time at most, not answers).
    harmless: bool = False
    known: str | None = None  # where it is a known failure: the property (``known.E2E``)

    def __str__(self) -> str:
        return self.name

    def cannot(self, cluster: Cluster) -> str | None:
        """Why ``cluster``'s backend cannot run this nemesis, or None."""
        for op in self.needs:
            reason = cluster.cannot(op)
            if reason:
                return reason
        return None


def _signal(pattern: str, signum: int, count: int | None = None, *,
            required: bool = True) -> Callable[[Cluster, str], None]:
    """A step sending ``signum`` to ``node``'s processes matching ``pattern``; ``required``: it
    fails when none matches (a heal's SIGCONT is not: harmless to a running one, none once gone)."""
    def step(cluster: Cluster, node: str) -> None:
        if not cluster.signal_process(node, pattern, signum, count) and required:
            raise RuntimeError(f"no process matching {pattern!r} found on {node}")

    return step


NEMESES = (
    Nemesis("kill-worker-node", "every process of the worker node killed at once (PP stage 1)", "worker",
            lambda c, n: c.kill(n), needs=("kill",)),
    Nemesis("kill-ray-worker-actor", "SIGKILL of the head's vLLM Ray worker actor processes (PP stage 0)", "head",
            _signal(RAY_WORKER_ACTOR, signal.SIGKILL), needs=("signal_process",)),
    Nemesis("pause-worker-node", f"the worker node frozen for {HOLD_S:.0f} s (longer than the step bound)", "worker",
            lambda c, n: c.pause(n), lambda c, n: c.resume(n), needs=("pause", "resume")),
    Nemesis("disconnect-worker-node", f"the worker node off the cluster network for {HOLD_S:.0f} s", "worker",
            lambda c, n: c.isolate(n), lambda c, n: c.rejoin(n), needs=("isolate", "rejoin")),
    Nemesis("restart-worker-node", "the worker node stopped and started again", "worker",
            lambda c, n: c.restart(n), needs=("restart",)),
    # Aimed at the zero-copy paths (a frozen reader must not hold the writer past the step timeout):
    Nemesis("pause-worker-node-large", f"the worker node frozen for {HOLD_S:.0f} s while >= 16 MiB scheduler steps "
            "(prompt_embeds batches) cross to it: past the socket buffers, ZMQ cannot finish a send", "worker",
            lambda c, n: c.pause(n), lambda c, n: c.resume(n), needs=("pause", "resume"), workload="large"),
    Nemesis("stop-ray-worker-actor", f"one Ray worker actor of the worker node (one TP rank of PP stage 1) SIGSTOPped "
            f"for {HOLD_S:.0f} s, its node healthy: a gray failure, one slow rank", "worker",
            _signal(RAY_WORKER_ACTOR, signal.SIGSTOP, count=1), _signal(RAY_WORKER_ACTOR, signal.SIGCONT, required=False),
            needs=("signal_process",), harmless=True),
    Nemesis("fill-worker-shm", f"the worker node's /dev/shm filled to its last byte for {HOLD_S:.0f} s", "worker",
            lambda c, n: c.fill_shm(n), lambda c, n: c.free_shm(n), needs=("fill_shm", "free_shm"), harmless=True),
    Nemesis("fill-head-shm", f"the head's /dev/shm filled to its last byte for {HOLD_S:.0f} s: the engine's "
            "MessageQueue rings live there", "head",
            lambda c, n: c.fill_shm(n), lambda c, n: c.free_shm(n), needs=("fill_shm", "free_shm"), harmless=True,
            known="ring_reserved"),
    Nemesis("kill-head-gcs", "SIGKILL of the head's Ray GCS (gcs_server): every Ray process loses its control plane",
            "head", _signal("gcs_server", signal.SIGKILL), needs=("signal_process",)),
)


def by_name(name: str) -> Nemesis:
    for nemesis in NEMESES:
        if nemesis.name == name:
            return nemesis
    raise LookupError(f"no nemesis {name!r}; known: {', '.join(n.name for n in NEMESES)}")


@dataclass(frozen=True)
class Schedule:
    lead_s: float = 5.0  # the workload runs this long before the fault
    hold_s: float = HOLD_S  # the fault stays this long, then is healed
    bound_s: float = BOUND_S  # requests keep starting this long after the fault


def run(cluster: Cluster, nemesis: Nemesis, stream: Stream, history: History, profile: str,
        schedule: Schedule = Schedule(), *, join_s: float = 120.0) -> Event:
    """Run ``stream`` beside ``nemesis`` on ``schedule``; return the apply event (its time is the
    fault's). The heal runs, and the stream is stopped and joined (``join_s``), also when the
    nemesis raised: then a ``failed`` event is recorded and the error raised."""

    def note(phase: str, at: float, detail: str = "") -> Event:
        return history.add_event(Event(at, nemesis.name, phase, nemesis.target, profile, detail))

    stream.start()
    time.sleep(schedule.lead_s)
    applied = note("apply", time.time())  # the fault time: when we began to apply it
    stream.stop(applied.at + schedule.bound_s)
    failure: BaseException | None = None
    try:
        nemesis.apply(cluster, nemesis.target)
        time.sleep(max(0.0, applied.at + schedule.hold_s - time.time()))
    except Exception as exc:  # Unsupported too
        failure = exc
        note("failed", time.time(), f"{type(exc).__name__}: {exc}")
    try:
        nemesis.heal(cluster, nemesis.target)
        note("heal", time.time())
    finally:
        if failure is not None:
            stream.stop(time.time())  # nothing to measure: no more requests
        stream.join(join_s)
    if failure is not None:
        raise failure
    return applied
