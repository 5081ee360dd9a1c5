"""Fault schedules in the Jepsen manner: a seeded generator mixes faults over a bounded window, a
nemesis client runs them beside the workload, and every operation lands in the run's history.

``nemesis.py`` holds one fixed fault per test (lead, apply, hold, heal); here a schedule is data,
a list of ``Op`` (offset, fault kind, node, hold, parameters) drawn by ``generate`` from a seed,
the run's duration, the backend's operations and the cluster's nodes. Faults overlap where that
is safe (a slow link on one node while the other is paused), never two on one node, never two
that each take a node out of the cluster, at most ``max_concurrent`` at once, and none in the
quiet tail at the end, which is left to recovery. The same inputs give the same schedule, and a
schedule written to ``schedule.json`` replays exactly (``read``). ``run`` executes the operations
in order against the ``Cluster`` interface in one thread (Jepsen's nemesis is a single client),
recording each step's start, end and error; ``checker/schedule.py`` judges what was recorded.

``python -m vllm_zerocopy_testbed.schedule --seed 1 --duration 10m`` prints a schedule without
touching a cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.host_config import parse_duration
from vllm_zerocopy_testbed.workload.requests import Event, History

logger = logging.getLogger(__name__)

SCHEDULE_ENV = "TESTBED_SCHEDULE"  # "random": the schedule test runs (make faults SCHEDULE=random)
SEED_ENV = "TESTBED_SEED"
DURATION_ENV = "TESTBED_DURATION"
SCHEDULE_FILE_ENV = "TESTBED_SCHEDULE_FILE"  # a schedule.json to replay instead of generating one
FORMAT = 1

# The workload runs alone this long first: its answers before any fault are the run's own reference.
LEAD_S = 15.0
# Left without faults at the end: a lost node comes back by itself in 26-90 s (docs/faults.md), a
# head restart with its warm-up in up to ~3 min on one core, and the last fault's recovery must be
# seen inside the run (the live test's recovery bound is shorter than this).
QUIET_S = 210.0
# After a fault that took a node out of the cluster, the next such fault waits this long (drawn
# from the range): most recoveries are then measured, not cut short by the next loss.
SETTLE_S = (90.0, 150.0)
# Between two operations' starts (drawn): faults arrive neither in lock-step nor all at once.
GAP_S = (5.0, 40.0)
MAX_CONCURRENT = 2


Step = Callable[[Cluster, "Op"], object]


def _nothing(cluster: Cluster, op: "Op") -> None:
    return None


def _kill_gcs(cluster: Cluster, op: "Op") -> list[int]:
    pids = cluster.signal_process(op.node, "gcs_server", signal.SIGKILL)
    if not pids:
        raise RuntimeError(f"no process matching 'gcs_server' found on {op.node}")
    return pids


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault: the ``Cluster`` operations it calls to apply and heal, how long it holds
    (a range the generator draws from; ``(0, 0)``: an instant operation with no heal) and whether
    it takes its node out of the cluster (``loses_node``: at most one such fault at a time)."""

    name: str
    what: str
    needs: tuple[str, ...]
    apply: Step
    heal: Step = _nothing
    hold_s: tuple[float, float] = (0.0, 0.0)
    loses_node: bool = True
    targets: tuple[str, ...] | None = None  # the nodes it may hit; None: any
    draw: Callable[[random.Random], dict[str, float]] = lambda rng: {}  # its parameters

    def cannot(self, cluster: Cluster) -> str | None:
        """Why ``cluster``'s backend cannot run this kind, or None."""
        return next((reason for reason in (cluster.cannot(op) for op in self.needs) if reason), None)


KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("kill", "every process of the node killed at once; at heal the node is started again (the host "
              "comes back)", ("kill", "restart"), lambda c, o: c.kill(o.node), lambda c, o: c.restart(o.node),
              hold_s=(5.0, 30.0)),
    FaultKind("pause", "every process of the node frozen (SIGSTOP, docker pause), resumed at heal",
              ("pause", "resume"), lambda c, o: c.pause(o.node), lambda c, o: c.resume(o.node), hold_s=(10.0, 45.0)),
    FaultKind("isolate", "the node off the cluster's network, its processes running; back at heal",
              ("isolate", "rejoin"), lambda c, o: c.isolate(o.node), lambda c, o: c.rejoin(o.node),
              hold_s=(10.0, 45.0)),
    FaultKind("slow-link", "what the node sends limited to rate_mbit Mbit/s (a token bucket), lifted at heal",
              ("shape", "unshape"), lambda c, o: c.shape(o.node, o.params["rate_mbit"]),  # type: ignore[attr-defined]
              lambda c, o: c.unshape(o.node), hold_s=(20.0, 90.0), loses_node=False,  # type: ignore[attr-defined]
              draw=lambda rng: {"rate_mbit": float(rng.choice((1, 2, 5, 10)))}),
    FaultKind("restart", "the node stopped (bounded grace) and started again", ("restart",),
              lambda c, o: c.restart(o.node)),
    FaultKind("kill-gcs", "SIGKILL of the head's Ray GCS (gcs_server): every Ray process loses its control plane",
              ("signal_process",), _kill_gcs, targets=("head",)),
)}


@dataclass(frozen=True)
class Op:
    """One scheduled fault: applied ``at_s`` after the schedule starts, healed ``hold_s`` later."""

    index: int
    at_s: float
    kind: str
    node: str
    hold_s: float
    params: dict[str, float] = field(default_factory=dict)

    @property
    def heal_s(self) -> float:
        return round(self.at_s + self.hold_s, 3)  # offsets are tenths: a heal and the next apply compare equal

    @property
    def label(self) -> str:
        """``03-pause``: the event kind in the history (unique per operation)."""
        return f"{self.index:02d}-{self.kind}"

    def __str__(self) -> str:
        params = "".join(f" {k}={v:g}" for k, v in self.params.items())
        return f"{self.label} {self.node} at {self.at_s:.1f} s for {self.hold_s:.1f} s{params}"


@dataclass(frozen=True)
class Schedule:
    """A whole fault schedule and what it was drawn from: the data ``schedule.json`` holds."""

    seed: int | None
    duration_s: float
    nodes: tuple[str, ...]
    kinds: tuple[str, ...]
    ops: tuple[Op, ...]
    lead_s: float = LEAD_S
    quiet_s: float = QUIET_S
    max_concurrent: int = MAX_CONCURRENT

    @property
    def faults_end_s(self) -> float:
        """No fault is in force from here on: the quiet tail."""
        return self.duration_s - self.quiet_s

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self), "nodes": list(self.nodes), "kinds": list(self.kinds),
                "ops": [asdict(op) for op in self.ops]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Schedule":
        if data.get("format") != FORMAT:
            raise ValueError(f"schedule format {data.get('format')!r} is not {FORMAT}: regenerate it with its seed")
        unknown = sorted({op["kind"] for op in data["ops"]} - set(KINDS))
        if unknown:
            raise ValueError(f"schedule names unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
        return cls(seed=data["seed"], duration_s=float(data["duration_s"]), nodes=tuple(data["nodes"]),
                   kinds=tuple(data["kinds"]), lead_s=float(data["lead_s"]), quiet_s=float(data["quiet_s"]),
                   max_concurrent=int(data["max_concurrent"]),
                   ops=tuple(Op(int(o["index"]), float(o["at_s"]), o["kind"], o["node"], float(o["hold_s"]),
                                {k: float(v) for k, v in o["params"].items()}) for o in data["ops"]))

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def describe(self) -> str:
        """One line per operation, the seed and window first."""
        head = (f"schedule seed={self.seed} duration={self.duration_s:.0f} s nodes={','.join(self.nodes)} "
                f"kinds={','.join(self.kinds)}: {len(self.ops)} fault(s), quiet from {self.faults_end_s:.0f} s")
        return "\n".join([head, *(f"  {op}" for op in self.ops)])


def read(path: Path) -> Schedule:
    """The schedule stored at ``path`` (a run's ``schedule.json``), to replay it exactly."""
    return Schedule.from_json(json.loads(Path(path).read_text()))


def supported(cluster: Cluster, kinds: Iterable[str] = KINDS) -> tuple[tuple[str, ...], dict[str, str]]:
    """The fault kinds ``cluster``'s backend can run, and why each other one cannot."""
    can, cannot = [], {}
    for name in kinds:
        reason = KINDS[name].cannot(cluster)
        if reason:
            cannot[name] = reason
        else:
            can.append(name)
    return tuple(can), cannot


def generate(seed: int, duration_s: float, nodes: Iterable[str], kinds: Iterable[str] = KINDS, *,
             lead_s: float = LEAD_S, quiet_s: float = QUIET_S, max_concurrent: int = MAX_CONCURRENT,
             settle_s: tuple[float, float] = SETTLE_S, gap_s: tuple[float, float] = GAP_S) -> Schedule:
    """Draw a schedule from ``random.Random(seed)``: the same arguments give the same schedule.

    Each step draws a kind, a node it may hit, a hold and parameters, then places the fault at
    the first time from the cursor where it fits: its node free, fewer than ``max_concurrent``
    faults in force, and, for a fault that loses its node, no other such fault in force or within
    its settle time. A fault that would end past ``duration_s - quiet_s`` is dropped; the
    generator stops after a run of such drops.
    """
    nodes, kinds = tuple(nodes), tuple(k for k in KINDS if k in set(kinds))  # catalog order: seed-stable
    if not nodes or not kinds:
        raise ValueError(f"a schedule needs nodes and fault kinds (nodes={nodes}, kinds={kinds})")
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
    faults_end = duration_s - quiet_s
    if faults_end <= lead_s:
        raise ValueError(f"a {duration_s:.0f} s schedule leaves no time for faults after the {lead_s:.0f} s lead "
                         f"and the {quiet_s:.0f} s quiet tail: ask for DURATION of at least "
                         f"{lead_s + quiet_s + 60:.0f} s")
    rng = random.Random(seed)
    placed: list[tuple[Op, float]] = []  # each op and when it stops blocking other node losses
    cursor, misses = lead_s, 0
    while misses < 8:
        kind = KINDS[rng.choice(kinds)]
        targets = [n for n in nodes if kind.targets is None or n in kind.targets]
        if not targets:
            misses += 1
            continue
        node = rng.choice(targets)
        hold = round(rng.uniform(*kind.hold_s), 1)
        params = kind.draw(rng)
        settle = round(rng.uniform(*settle_s), 1) if kind.loses_node else 0.0
        at = _first_fit(placed, cursor, node, kind.loses_node, max_concurrent)
        if at + hold > faults_end:
            misses += 1
            continue
        misses = 0
        op = Op(len(placed), at, kind.name, node, hold, params)
        placed.append((op, round(op.heal_s + settle, 3)))
        cursor = round(op.at_s + rng.uniform(*gap_s), 1)
    return Schedule(seed, duration_s, nodes, kinds, tuple(op for op, _ in placed), lead_s, quiet_s, max_concurrent)


def _first_fit(placed: list[tuple[Op, float]], cursor: float, node: str, loses: bool, max_concurrent: int) -> float:
    """The first time from ``cursor`` where a fault on ``node`` fits beside ``placed``. Every placed
    fault starts at or before ``cursor``, so one in force at a candidate time is in force for
    the whole of the new fault's start: checking the start is enough."""
    candidates = sorted({cursor, *(op.heal_s for op, _ in placed if op.heal_s > cursor),
                         *(until for _, until in placed if until > cursor)})
    for at in candidates:
        live = [op for op, _ in placed if op.heal_s > at or (op.hold_s == 0 and op.at_s == at)]
        if any(op.node == node for op in live) or len(live) >= max_concurrent:
            continue
        if loses and any(KINDS[op.kind].loses_node and until > at for op, until in placed):
            continue
        return at
    raise AssertionError("the last candidate is past every placed fault")  # unreachable: it always fits


# -- the nemesis client -----------------------------------------------------------------------------
@dataclass
class StepRecord:
    """What one step of one operation did: ``phase`` apply or heal, epoch times, its error."""

    index: int
    kind: str
    node: str
    phase: str
    started: float
    ended: float = 0.0
    error: str | None = None
    result: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ScheduleRun:
    """A schedule running in its thread: ``steps`` fills as it goes; ``join`` waits for the end."""

    schedule: Schedule
    started: float
    steps: list[StepRecord] = field(default_factory=list)
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def ends_at(self) -> float:
        return self.started + self.schedule.duration_s

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for every step (every heal included); whether it ended."""
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    def follow(self, timeout: float, every_s: float = 5.0) -> bool:
        """``join``, logging each step as it ends from the caller's thread (a progress display that
        shows only its own thread's lines then shows the schedule as it runs); whether it ended."""
        deadline, shown = time.monotonic() + timeout, 0
        while True:
            ended = self.join(max(0.0, min(every_s, deadline - time.monotonic())))
            done = [s for s in self.steps if s.ended]
            for record in done[shown:]:
                offset = record.started - self.started
                logger.info("schedule %s at %.0f s: %s %s %s%s", record.phase, offset, record.kind, record.node,
                            "ok" if record.ok else "FAILED", "" if record.ok else f" ({record.error})")
            shown = len(done)
            if ended or time.monotonic() >= deadline:
                return ended


def _timeline(schedule: Schedule) -> list[tuple[float, int, str, Op]]:
    """Every step in the order it runs: by time, a heal before an apply at the same time."""
    steps = [(op.at_s, 1, "apply", op) for op in schedule.ops]
    steps += [(op.heal_s, 0, "heal", op) for op in schedule.ops if KINDS[op.kind].heal is not _nothing]
    return sorted(steps, key=lambda s: (s[0], s[1], s[3].index))


def run(cluster: Cluster, schedule: Schedule, history: History, profile: str, *,
        started: float | None = None) -> ScheduleRun:
    """Start ``schedule`` against ``cluster`` in a thread, its offsets from ``started`` (now);
    return the run. Each step is recorded (``ScheduleRun.steps``) and becomes an ``Event`` in
    ``history`` (``apply``, ``heal``, ``failed`` with the error), so checkers read fault times
    from data. A step that raises is recorded and the schedule goes on; every heal runs, also
    of an operation whose apply failed and also once ``stop`` is set (then at once; no apply
    runs after it)."""
    begun = time.time() if started is None else started
    state = ScheduleRun(schedule, begun)

    def wait_until(at: float) -> None:
        delay = at - time.time()
        if delay > 0:
            state.stop.wait(delay)

    def step(phase: str, op: Op) -> None:
        kind = KINDS[op.kind]
        record = StepRecord(op.index, op.kind, op.node, phase, time.time())
        state.steps.append(record)
        history.add_event(Event(record.started, op.label, phase, op.node, profile, str(op)))
        logger.info("schedule: %s %s", phase, op)
        try:
            result = (kind.apply if phase == "apply" else kind.heal)(cluster, op)
            record.result = "" if result is None else str(result)[:200]
        except Exception as exc:  # Unsupported too: recorded, the schedule goes on
            record.error = f"{type(exc).__name__}: {exc}"[:500]
            history.add_event(Event(time.time(), op.label, "failed", op.node, profile, f"{phase}: {record.error}"))
            logger.warning("schedule: %s %s failed: %s", phase, op, record.error)
        record.ended = time.time()

    def client() -> None:
        applied: set[int] = set()
        for at, _, phase, op in _timeline(schedule):
            if (phase == "apply" and state.stop.is_set()) or (phase == "heal" and op.index not in applied):
                continue  # stopped: no new fault, and no heal of one never applied (kill's heal starts a node)
            if not state.stop.is_set():
                wait_until(begun + at)
            if phase == "apply" and state.stop.is_set():
                continue  # stopped while it waited
            applied.add(op.index)
            step(phase, op)

    state.thread = threading.Thread(target=client, daemon=True, name="schedule-nemesis")
    state.thread.start()
    return state


def from_env(cluster: Cluster, env: Mapping[str, str], run_dir: Path) -> tuple[Schedule, Path, dict[str, str]]:
    """The run's schedule: replayed from ``TESTBED_SCHEDULE_FILE`` or generated from ``TESTBED_SEED``
    (default 1) and ``TESTBED_DURATION`` (default 10m) over the backend's kinds and the cluster's
    nodes; written to ``run_dir/schedule.json`` before it runs. Also returns the kinds left out, why."""
    kinds, lacking = supported(cluster)
    replay = env.get(SCHEDULE_FILE_ENV, "").strip()
    if replay:
        schedule = read(Path(replay))
        missing = sorted({op.kind for op in schedule.ops} - set(kinds))
        if missing:
            raise ValueError(f"{replay} needs fault kinds this backend cannot run: "
                             + "; ".join(f"{k}: {lacking.get(k, 'unknown')}" for k in missing))
    else:
        raw = env.get(SEED_ENV, "").strip() or "1"
        if not raw.isdigit():
            raise ValueError(f"SEED={raw!r}: use a whole number, e.g. make faults SCHEDULE=random SEED=1")
        seed = int(raw)
        duration = parse_duration(env.get(DURATION_ENV, "").strip() or "10m", "DURATION")
        schedule = generate(seed, duration, cluster.nodes(), kinds)
    path = schedule.write(run_dir / "schedule.json")
    logger.info("%s\nwritten to %s (%s=%s replays it)%s", schedule.describe(), path, SCHEDULE_FILE_ENV, path,
                "".join(f"\n  not run on this backend: {kind}: {why}" for kind, why in lacking.items()))
    return schedule, path, lacking


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_zerocopy_testbed.schedule",
                                     description="print the fault schedule a seed gives (no cluster touched)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", default="10m")
    parser.add_argument("--nodes", default="head,worker")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"from {', '.join(KINDS)}")
    parser.add_argument("--json", action="store_true", help="the schedule.json text instead of lines")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    schedule = generate(args.seed, parse_duration(args.duration), args.nodes.split(","), args.kinds.split(","))
    print(json.dumps(schedule.to_json(), indent=2) if args.json else schedule.describe())


if __name__ == "__main__":
    main()
