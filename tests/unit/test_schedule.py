"""Fault schedules: the seeded generator's bounds, replay from file, the nemesis client, and the
checkers' verdicts on hand-made histories (a hang, an error in a fault, a wrong answer, no recovery)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from loopback import BlindCluster, Loopback

from vllm_zerocopy_testbed import schedule as schedules
from vllm_zerocopy_testbed.checker import bitexact
from vllm_zerocopy_testbed.checker import schedule as judge
from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, History, Record
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import Stream

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NODES = ("head", "worker")
SEEDS = range(40)


def _live_at(ops: tuple[schedules.Op, ...], at: float) -> list[schedules.Op]:
    return [op for op in ops if op.at_s <= at < op.heal_s or (op.hold_s == 0 and op.at_s == at)]


def test_the_same_seed_duration_and_nodes_give_the_same_schedule() -> None:
    first = schedules.generate(7, 600, NODES)
    assert first == schedules.generate(7, 600, NODES)
    assert first.ops, "ten minutes hold faults"
    assert first != schedules.generate(8, 600, NODES), "another seed, another schedule"
    assert schedules.generate(7, 600, NODES, ["pause", "kill"]) == schedules.generate(7, 600, NODES, ["kill", "pause"])


@pytest.mark.parametrize("seed", SEEDS)
def test_no_fault_outside_the_window_and_the_quiet_tail_is_kept(seed: int) -> None:
    s = schedules.generate(seed, 600, NODES)
    assert all(s.lead_s <= op.at_s and op.heal_s <= s.faults_end_s for op in s.ops), s.describe()
    assert s.faults_end_s == 600 - schedules.QUIET_S
    assert [op.at_s for op in s.ops] == sorted(op.at_s for op in s.ops)
    assert [op.index for op in s.ops] == list(range(len(s.ops)))


@pytest.mark.parametrize("seed", SEEDS)
def test_concurrency_one_fault_per_node_and_one_node_loss_at_a_time(seed: int) -> None:
    s = schedules.generate(seed, 1200, ("head", "worker", "worker-2"), max_concurrent=2)
    for op in s.ops:
        live = _live_at(s.ops, op.at_s)
        assert len(live) <= 2, f"{[str(o) for o in live]} at {op.at_s}"
        assert len({o.node for o in live}) == len(live), f"two faults on one node: {[str(o) for o in live]}"
        losses = [o for o in live if schedules.KINDS[o.kind].loses_node]
        assert len(losses) <= 1, f"two node losses at once: {[str(o) for o in losses]}"
    losses = [op for op in s.ops if schedules.KINDS[op.kind].loses_node]
    for a, b in zip(losses, losses[1:]):
        assert b.at_s >= a.heal_s + schedules.SETTLE_S[0], f"{a} then {b}: no settle between two losses"


def test_faults_overlap_where_safe() -> None:
    """Jepsen's point: faults mix. Over seeds, some slow link runs beside a node loss."""
    overlapping = 0
    for seed in SEEDS:
        s = schedules.generate(seed, 600, NODES)
        overlapping += any(len(_live_at(s.ops, op.at_s)) > 1 for op in s.ops)
    assert overlapping >= 5, overlapping


def test_only_kinds_the_backend_can_run_and_nodes_they_may_hit() -> None:
    s = schedules.generate(3, 3600, NODES, ["kill-gcs", "pause"])
    assert {op.kind for op in s.ops} == {"kill-gcs", "pause"}
    assert all(op.node == "head" for op in s.ops if op.kind == "kill-gcs")
    assert all(op.params["rate_mbit"] in (1, 2, 5, 10) for op in schedules.generate(3, 3600, NODES, ["slow-link"]).ops)
    with pytest.raises(ValueError, match="at least"):
        schedules.generate(1, 120, NODES)


def test_a_written_schedule_replays_exactly(tmp_path) -> None:
    s = schedules.generate(11, 900, NODES)
    path = s.write(tmp_path / "run" / "schedule.json")
    assert schedules.read(path) == s
    data = json.loads(path.read_text())
    assert data["seed"] == 11 and data["format"] == schedules.FORMAT and len(data["ops"]) == len(s.ops)
    data["ops"][0]["kind"] = "meteor"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedules.read(path)


class Recording(BlindCluster, Cluster):
    """A cluster that records the nemesis operations called on it; ``kill`` raises on demand."""

    def __init__(self, fail_kill: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_kill = fail_kill

    base_url = "http://127.0.0.1:9/v1"  # type: ignore[assignment]

    def up(self) -> float:
        return 0.0

    def down(self) -> None:
        pass

    def is_running(self) -> bool:
        return True

    def kill(self, node: str) -> None:
        self.calls.append(("kill", node))
        if self.fail_kill:
            raise RuntimeError("no such container")

    def restart(self, node: str) -> None:
        self.calls.append(("restart", node))

    def pause(self, node: str) -> None:
        self.calls.append(("pause", node))

    def resume(self, node: str) -> None:
        self.calls.append(("resume", node))


def _hand_made(ops: list[schedules.Op], duration_s: float = 2.0) -> schedules.Schedule:
    return schedules.Schedule(None, duration_s, NODES, tuple(sorted({o.kind for o in ops})), tuple(ops), 0.0, 0.5)


def test_the_backend_says_which_kinds_it_lacks() -> None:
    kinds, lacking = schedules.supported(Recording())
    assert kinds == ("kill", "pause", "restart")
    assert "has no 'isolate'" in lacking["isolate"] and "has no 'shape'" in lacking["slow-link"]


def test_the_runner_applies_and_heals_in_time_order_and_records_each_step() -> None:
    cluster, history = Recording(), History()
    plan = _hand_made([schedules.Op(0, 0.1, "pause", "worker", 0.4), schedules.Op(1, 0.2, "kill", "head", 0.1)])
    started = time.time()
    running = schedules.run(cluster, plan, history, "p", started=started)
    assert running.join(10)
    assert cluster.calls == [("pause", "worker"), ("kill", "head"), ("restart", "head"), ("resume", "worker")]
    steps = {(s.index, s.phase): s for s in running.steps}
    assert steps[(0, "apply")].started >= started + 0.1 and steps[(0, "heal")].started >= started + 0.5
    assert [(e.kind, e.phase) for e in history.events()] == [("00-pause", "apply"), ("01-kill", "apply"),
                                                             ("01-kill", "heal"), ("00-pause", "heal")]
    faults = judge.windows(running.steps)
    assert [(w.label, w.error) for w in faults] == [("00-pause worker", None), ("01-kill head", None)]
    assert judge.check_steps(faults, 2).ok


def test_following_a_run_shows_each_step_from_the_callers_thread(caplog) -> None:
    """The live progress display prints only the main thread's lines: ``follow`` logs the steps there."""
    plan = _hand_made([schedules.Op(0, 0.1, "pause", "worker", 0.3), schedules.Op(1, 0.2, "kill", "head", 0.1)])
    caplog.set_level("INFO", logger=schedules.logger.name)
    running = schedules.run(Recording(fail_kill=True), plan, History(), "p")
    assert running.follow(10, every_s=0.05)
    shown = [r for r in caplog.records if r.getMessage().startswith("schedule ") and " at " in r.getMessage()]
    assert {r.threadName for r in shown} == {threading.current_thread().name}
    assert [r.getMessage().split(": ", 1)[1].split(" (")[0] for r in shown] == [
        "pause worker ok", "kill head FAILED", "kill head ok", "pause worker ok"]


def test_a_failed_apply_is_recorded_healed_and_the_schedule_goes_on() -> None:
    cluster, history = Recording(fail_kill=True), History()
    plan = _hand_made([schedules.Op(0, 0.0, "kill", "worker", 0.1), schedules.Op(1, 0.2, "pause", "head", 0.1)])
    running = schedules.run(cluster, plan, history, "p")
    assert running.join(10)
    assert ("restart", "worker") in cluster.calls, "the heal runs although the apply failed"
    assert ("pause", "head") in cluster.calls and ("resume", "head") in cluster.calls
    assert [e.phase for e in history.events(kind="00-kill")] == ["apply", "failed", "heal"]
    verdict = judge.check_steps(judge.windows(running.steps), 2)
    assert verdict.ok and verdict.figures["failed_applies"] == 1, "a fault that did not land is unknown, not red"


def test_a_failed_heal_or_an_operation_never_applied_is_red() -> None:
    hurt = judge.Window(0, "pause", "worker", T0, T0 + 5, "heal: RuntimeError: docker unpause timed out")
    verdict = judge.check_steps([hurt], 2)
    assert verdict.problems == ["00-pause worker: heal: RuntimeError: docker unpause timed out",
                                "1 of 2 operation(s) never applied"]


def test_a_stopped_schedule_heals_what_it_applied_and_applies_nothing_more() -> None:
    cluster = Recording()
    plan = _hand_made([schedules.Op(0, 0.0, "pause", "worker", 30.0), schedules.Op(1, 20.0, "kill", "head", 1.0)],
                      duration_s=60)
    running = schedules.run(cluster, plan, History(), "p")
    threading.Timer(0.3, running.stop.set).start()
    assert running.join(10)
    assert cluster.calls == [("pause", "worker"), ("resume", "worker")]


# -- checkers on hand-made histories ----------------------------------------------------------------
T0 = 1000.0
PAUSE = judge.Window(0, "pause", "worker", T0 + 10, T0 + 40)


def _record(key: str, started: float, latency: float, status: str = "ok", tokens: tuple[int, ...] = (1, 2),
            bound: float = 120.0) -> Record:
    return Record(key, "schedule", "p", bound, started=T0 + started, latency_s=latency, status=status,
                  error=None if status == "ok" else "Error code: 500 - EngineCore encountered an issue",
                  choices=[{"text": "", "tokens": list(tokens), "token_logprobs": [-0.5] * len(tokens),
                            "top_logprobs": []}])


def _healthy_run() -> list[Record]:
    return [_record("a", 0, 1), _record("a", 5, 1), _record("a", 9, 20, "error"), _record("a", 30, 1, "error"),
            _record("a", 45, 2), _record("a", 60, 1)]


def test_a_run_with_errors_only_inside_the_fault_is_green() -> None:
    records = _healthy_run()
    assert judge.check_bound(records, [PAUSE], 60).ok
    assert judge.check_errors(records, [PAUSE], T0 + 100).ok
    verdict = judge.check_recovery(records, [PAUSE], 30, T0 + 100)
    assert verdict.ok and verdict.figures["00-pause_s"] == pytest.approx(7.0), verdict.figures


def test_a_hang_is_red() -> None:
    records = [*_healthy_run(), _record("a", 50, 120, "timeout")]
    verdict = judge.check_bound(records, [PAUSE], 60)
    assert not verdict.ok and "HANG" in verdict.problems[0]


def test_an_answer_past_the_bound_after_the_fault_is_red() -> None:
    records = [*_healthy_run(), _record("a", 8, 75, "error")]  # ended 73 s after the fault
    verdict = judge.check_bound(records, [PAUSE], 60)
    assert not verdict.ok and "after the fault" in verdict.problems[0]


def test_an_error_with_no_fault_in_force_is_red() -> None:
    records = [*_healthy_run(), _record("a", 70, 1, "error")]  # recovered at 47: this one fails later
    verdict = judge.check_errors(records, [PAUSE], T0 + 100)
    assert not verdict.ok and "no fault in force" in verdict.problems[0]


def test_a_missing_recovery_is_red_and_one_cut_short_by_the_next_fault_is_unknown() -> None:
    records = [_record("a", 0, 1), _record("a", 45, 1, "error"), _record("a", 80, 1, "error")]
    verdict = judge.check_recovery(records, [PAUSE], 30, T0 + 100)
    assert not verdict.ok and "not recovered within 30 s" in verdict.problems[0]
    assert verdict.figures["00-pause_s"] == -1.0
    next_fault = judge.Window(1, "kill", "head", T0 + 50, T0 + 55)  # 10 s after the heal: no time to recover
    cut = judge.check_recovery(records, [PAUSE, next_fault], 30, T0 + 200)
    assert [p.split(":")[0] for p in cut.problems] == ["01-kill head"], cut.problems


def test_a_late_recovery_is_red() -> None:
    records = [_record("a", 0, 1), _record("a", 90, 1)]
    verdict = judge.check_recovery(records, [PAUSE], 30, T0 + 200)
    assert not verdict.ok and "the first good answer 51 s after it" in verdict.problems[0]


def test_a_wrong_answer_after_recovery_is_red() -> None:
    before = bitexact.first_answers([_record("a", 0, 1)])
    assert bitexact.check([_record("a", 60, 1)], before).ok
    verdict = bitexact.check([_record("a", 60, 1, tokens=(1, 3))], before)
    assert not verdict.ok and "tokens [1, 2] vs [1, 3]" in verdict.problems[0]


def test_a_node_left_hurt_or_a_leftover_is_red() -> None:
    assert judge.check_left_behind({"head": "running", "worker": "running"}).ok
    verdict = judge.check_left_behind({"head": "running", "worker": "paused"}, ["/dev/shm/testbed-fill"])
    assert verdict.problems == ["worker is paused after the schedule and its recovery",
                                "left behind: /dev/shm/testbed-fill"]


def test_windows_read_stored_step_records_as_the_runner_wrote_them() -> None:
    steps = [schedules.StepRecord(0, "pause", "worker", "apply", T0 + 10, T0 + 11).to_json(),
             schedules.StepRecord(0, "pause", "worker", "heal", T0 + 39, T0 + 40).to_json(),
             schedules.StepRecord(1, "kill-gcs", "head", "apply", T0 + 50, T0 + 51, error="RuntimeError: none").to_json()]
    assert judge.windows(json.loads(json.dumps(steps))) == [
        PAUSE, judge.Window(1, "kill-gcs", "head", T0 + 50, T0 + 51, "apply: RuntimeError: none")]


# -- a whole short run: stream, schedule and checkers against a loopback server ---------------------
class Flaky(Recording):
    """A recording cluster in front of a loopback server that stops answering while a node is
    paused; ``stays_down``: it never answers again (a cluster that does not come back)."""

    def __init__(self, stays_down: bool = False) -> None:
        super().__init__()
        self.answering, self.stays_down = True, stays_down
        self.http = Loopback(self.route)
        self.base_url = f"{self.http.url}/v1"  # type: ignore[misc]

    def route(self, method: str, path: str) -> tuple[int, object]:
        if method == "GET" or self.answering:
            return 200, {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return 500, {"error": {"message": "EngineCore encountered an issue"}}

    def pause(self, node: str) -> None:
        super().pause(node)
        self.answering = False

    def resume(self, node: str) -> None:
        super().resume(node)
        self.answering = not self.stays_down

    def state(self, node: str) -> str:
        return "running"


def _short_run(cluster: Flaky) -> list:
    history = History()
    runner = Runner(cluster.base_url, "m", history, "p", timeout_s=5)
    specs = [CompletionSpec("a", prompt_ids=(1, 2, 3), max_tokens=1)]
    before = runner.run("before", specs)
    plan = schedules.Schedule(None, 2.5, NODES, ("pause",), (schedules.Op(0, 0.3, "pause", "worker", 0.5),), 0.3, 1.5)
    stream = Stream(runner, specs, suite="schedule", retry_s=0.05)
    started = time.time()
    stream.stop(started + plan.duration_s)
    stream.start()
    running = schedules.run(cluster, plan, history, "p", started=started)
    assert running.join(10) and stream.join(15)
    data = {"schedule": plan.to_json(), "steps": [s.to_json() for s in running.steps], "ends_at": running.ends_at,
            "bound_s": 5.0, "recovery_bound_s": 1.0, "records": [r.to_json() for r in stream.records],
            "before": [r.to_json() for r in before], "after": [r.to_json() for r in runner.run("after", specs)],
            "states": {n: cluster.state(n) for n in NODES}}
    return checks_of(json.loads(json.dumps(data)))


def checks_of(data: dict) -> list:
    return [v for v in judge.check_run(data) if not v.ok]


def test_a_short_run_that_recovers_is_green_from_what_it_stored() -> None:
    cluster = Flaky()
    try:
        failed = _short_run(cluster)
    finally:
        cluster.http.close()
    assert not failed, "\n".join(map(str, failed))
    assert cluster.calls == [("pause", "worker"), ("resume", "worker")]


def test_a_short_run_that_does_not_recover_is_red() -> None:
    cluster = Flaky(stays_down=True)
    try:
        failed = {v.checker: v for v in _short_run(cluster)}
    finally:
        cluster.http.close()
    assert "not recovered within 1 s" in str(failed["recovery"])
    assert "bit-exact after recovery" in failed  # nothing answered after it


def test_the_run_writes_its_schedule_and_a_named_file_replays_it(tmp_path) -> None:
    cluster = Recording()
    generated, path, lacking = schedules.from_env(cluster, {schedules.SEED_ENV: "5", schedules.DURATION_ENV: "15m"},
                                                  tmp_path / "first")
    assert path == tmp_path / "first" / "schedule.json" and schedules.read(path) == generated
    assert generated == schedules.generate(5, 900, NODES, ("kill", "pause", "restart"))
    assert set(lacking) == {"isolate", "slow-link", "kill-gcs"}
    replayed, again, _ = schedules.from_env(cluster, {schedules.SCHEDULE_FILE_ENV: str(path),
                                                      schedules.SEED_ENV: "6"}, tmp_path / "replay")
    assert replayed == generated and again.read_text() == path.read_text(), "the file wins over the seed"
    other = schedules.generate(1, 900, NODES, ("isolate",)).write(tmp_path / "isolate.json")
    with pytest.raises(ValueError, match="cannot run: isolate: Recording has no 'isolate'"):
        schedules.from_env(cluster, {schedules.SCHEDULE_FILE_ENV: str(other)}, tmp_path / "x")
    with pytest.raises(ValueError, match="SEED='one'"):
        schedules.from_env(cluster, {schedules.SEED_ENV: "one"}, tmp_path / "y")


def test_each_backend_says_which_fault_kinds_it_can_run() -> None:
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster
    from vllm_zerocopy_testbed.cluster.external import ExternalCluster
    from vllm_zerocopy_testbed.cluster.local_vllm import LocalVllmCluster

    compose, local, external = (object.__new__(c) for c in (ComposeCluster, LocalVllmCluster, ExternalCluster))
    assert schedules.supported(compose) == (tuple(schedules.KINDS), {})
    kinds, lacking = schedules.supported(local)
    assert kinds == ("kill", "pause", "restart", "kill-gcs") and "one network namespace" in lacking["isolate"]
    assert schedules.supported(external)[0] == (), "an external cluster is never hurt"
