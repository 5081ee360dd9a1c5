"""The fault workload's library parts: the stream, the health watch, recovery, the nemesis schedule.

Against a real HTTP server on loopback that answers like vLLM's OpenAI server (``/health``,
``/v1/completions``) and can be made to fail, and a "cluster" of one real process that the
nemesis stops and continues with signals.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import subprocess
import threading
import time

import pytest
from loopback import BlindCluster, Loopback

from vllm_zerocopy_testbed import nemesis as nemeses
from vllm_zerocopy_testbed.checker import faults
from vllm_zerocopy_testbed.cluster import recovery
from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.cluster.process import is_stopped
from vllm_zerocopy_testbed.waits import wait_until
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, History
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import HealthWatch, Stream

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Server:
    """A loopback server with vLLM's two routes; ``healthy`` and ``answering`` switch it."""

    def __init__(self) -> None:
        self.healthy = self.answering = True
        self.http = Loopback(self.route)
        self.url = self.http.url

    def route(self, method: str, path: str) -> tuple[int, object]:
        if method == "GET":
            return (200 if self.healthy else 503), {}
        if not self.answering:
            return 500, {"error": {"message": "EngineCore encountered an issue"}}
        return 200, {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def server():
    running = Server()
    yield running
    running.close()


# A client checks the stop time, then sends: its request may start just after. In between the
# runner builds its openai client (an SSL context: 39 ms on average, 54 ms at most on a quiet
# 2-core machine; a CI run under load once took longer than a 0.05 s slack). A stream that
# ignored the stop would keep starting requests until it is joined, seconds later.
SLACK_S = 1.0
SPECS = [CompletionSpec("a", prompt_ids=(1, 2, 3), max_tokens=1), CompletionSpec("b", prompt_ids=(4, 5), max_tokens=1)]


def _runner(server: Server, history: History) -> Runner:
    return Runner(f"{server.url}/v1", "m", history, "p", timeout_s=5)


def test_a_runner_wakes_its_paused_server_for_its_own_runs(server: Server) -> None:
    """A paused reference server answers the runner's own requests only while they run (a paused
    one would leave every request to its bound)."""
    server.answering = False  # paused: what it would answer is no answer

    @contextlib.contextmanager
    def awake():
        server.answering = True
        try:
            yield
        finally:
            server.answering = False

    runner = Runner(f"{server.url}/v1", "m", History(), "reference", timeout_s=5, awake=awake)
    assert all(r.ok for r in runner.run("own", SPECS))
    assert not server.answering, "paused again after the run"


def test_the_stream_sends_until_stopped_and_keeps_every_failure(server: Server) -> None:
    history = History()
    stream = Stream(_runner(server, history), SPECS, clients=2, retry_s=0.1).start()
    # Waits on what happened, not fixed sleeps: a busy machine's first requests can take seconds.
    wait_until("both specs answered", lambda: {r.key for r in list(stream.records) if r.ok} == {"a", "b"},
               timeout=30, poll_s=0.05)
    server.answering = False
    failing_from = time.time()
    wait_until("a failed request", lambda: any(not r.ok for r in list(stream.records)), timeout=30, poll_s=0.05)
    stop_at = time.time()
    stream.stop(stop_at)
    assert stream.join(10), "every client ended once stopped"
    keys = {r.key for r in stream.records}
    assert keys == {"a", "b"}, "the clients go through every spec"
    assert any(r.ok for r in stream.records) and any(not r.ok and r.http_status == 500 for r in stream.records)
    assert all(r.started <= stop_at + SLACK_S for r in stream.records), "no request starts after the stop"
    late_ok = [r for r in stream.records if r.ok and r.started > failing_from]
    assert not late_ok, "a failing server answers nothing"
    assert len(history.records()) == len(stream.records), "every request is in the history too"


def test_the_health_watch_remembers_when_health_first_failed(server: Server) -> None:
    with HealthWatch(server.url, poll_s=0.05) as health:
        time.sleep(0.3)
        assert health.first_unhealthy is None
        at = time.time()
        server.healthy = False
        time.sleep(0.3)
        server.healthy = True
        time.sleep(0.2)
    after = health.unhealthy_after(at)
    assert after is not None and 0 <= after < 2.0, after  # polled every 0.05 s; slack for a busy machine
    assert health.polls >= 10


class OneProcess(BlindCluster, Cluster):
    """A "cluster" of one real process (``sleep``) and the loopback server: what the nemesis
    schedule and recovery need, signals and HTTP for real."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.ups = 0
        self.healed: list[str] = []

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    def up(self) -> float:
        self.ups += 1
        self.server.answering = True
        return 0.0

    def down(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def pause(self, node: str) -> None:
        self.proc.send_signal(signal.SIGSTOP)
        self.server.answering = False

    def resume(self, node: str) -> None:
        self.healed.append(node)
        self.proc.send_signal(signal.SIGCONT)

    def state(self, node: str) -> str:
        return "exited" if self.proc.poll() is not None else ("paused" if is_stopped(self.proc.pid) else "running")


@pytest.fixture
def one(server: Server):
    cluster = OneProcess(server)
    yield cluster
    cluster.down()


QUICK = nemeses.Schedule(lead_s=0.3, hold_s=0.5, bound_s=1.0)


def test_the_schedule_records_apply_and_heal_in_the_history_and_the_checker_reads_them(one: OneProcess) -> None:
    history = History()
    pause = nemeses.by_name("pause-worker-node")
    stream = Stream(_runner(one.server, history), SPECS, retry_s=0.05)
    applied = nemeses.run(one, pause, stream, history, "p", QUICK, join_s=10)
    events = history.events(kind=pause.name)
    assert [e.phase for e in events] == ["apply", "heal"] and events[0] is applied
    assert events[1].at - applied.at >= QUICK.hold_s, "held for the schedule's hold"
    assert one.healed == ["worker"] and not is_stopped(one.proc.pid), "healed: the process runs again"
    assert all(r.started <= applied.at + QUICK.bound_s + SLACK_S for r in stream.records)
    verdict = faults.check(stream.records, events, bound_s=5.0)
    assert verdict.ok and verdict.figures["failed"] >= 1, verdict


def test_a_nemesis_that_fails_is_recorded_healed_and_raised(one: OneProcess) -> None:
    history = History()

    def broken(cluster: Cluster, node: str) -> None:
        raise RuntimeError("no such container")

    nemesis = nemeses.Nemesis("broken", "raises", "worker", broken, lambda c, n: c.resume(n))
    stream = Stream(_runner(one.server, history), SPECS)
    with pytest.raises(RuntimeError, match="no such container"):
        nemeses.run(one, nemesis, stream, history, "p", QUICK, join_s=10)
    assert [e.phase for e in history.events()] == ["apply", "failed", "heal"]
    assert one.healed == ["worker"], "the heal runs although the nemesis failed"
    assert not faults.check(stream.records, history.events(), 60.0).ok


def test_a_nemesis_says_which_backend_operation_it_lacks(one: OneProcess) -> None:
    assert nemeses.by_name("pause-worker-node").cannot(one) is None
    assert "has no 'isolate'" in nemeses.by_name("disconnect-worker-node").cannot(one)
    with pytest.raises(LookupError, match="known: kill-worker-node"):
        nemeses.by_name("no-such")


def test_recovery_waits_for_the_cluster_to_answer_by_itself(one: OneProcess) -> None:
    one.server.answering = False
    threading.Timer(0.5, lambda: setattr(one.server, "answering", True)).start()
    got = recovery.recover(one, "m", self_recovery_s=10, poll_s=0.1)
    assert got.how == "by itself" and 0.4 < got.seconds < 5 and one.ups == 0


def test_recovery_brings_the_cluster_up_when_it_does_not_come_back_within_the_bound(one: OneProcess) -> None:
    one.server.answering = False
    got = recovery.recover(one, "m", self_recovery_s=0.5, poll_s=0.1)
    assert got.how == "make up" and one.ups == 1 and "not after" in got.why
    assert recovery.answers(one.base_url, "m")


def test_recovery_does_not_wait_for_a_node_that_nothing_restarts(one: OneProcess, monkeypatch) -> None:
    monkeypatch.setattr(recovery, "STOPPED_FOR_GOOD_S", 0.2)
    one.server.answering = False
    one.proc.kill()
    one.proc.wait(5)
    got = recovery.recover(one, "m", self_recovery_s=30, poll_s=0.1)
    assert got.how == "make up" and got.seconds < 5 and "head exited" in got.why, got


def test_each_backend_says_which_nemeses_it_can_run() -> None:
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster
    from vllm_zerocopy_testbed.cluster.external import ExternalCluster
    from vllm_zerocopy_testbed.cluster.interface import NEMESIS_OPERATIONS
    from vllm_zerocopy_testbed.cluster.local_vllm import LocalVllmCluster

    assert all(set(n.needs) <= set(NEMESIS_OPERATIONS) for n in nemeses.NEMESES)
    compose, local, external = (object.__new__(c) for c in (ComposeCluster, LocalVllmCluster, ExternalCluster))
    assert [n.name for n in nemeses.NEMESES if n.cannot(compose)] == []
    assert [n.name for n in nemeses.NEMESES if n.cannot(local)] == ["disconnect-worker-node", "fill-worker-shm",
                                                                         "fill-head-shm"]
    assert "share this machine's /dev/shm" in nemeses.by_name("fill-worker-shm").cannot(local)
    assert all(n.cannot(external) for n in nemeses.NEMESES), "an external cluster is never hurt"


def test_a_run_says_what_it_sends_and_how_it_ended(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """The progress lines `make e2e` shows as they happen: what is sent, then the answers,
    the seconds and how many were not ok, for each way of running."""
    runner = _runner(server, History())
    with caplog.at_level(logging.INFO, logger="vllm_zerocopy_testbed.workload.runner"):
        runner.run("plain", SPECS, concurrency=2)
        server.answering = False
        runner.run("logprobs", SPECS)
        runner.run_for("sequential", SPECS, seconds=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "p plain: sending 2 request(s), 2 at a time"
    assert re.fullmatch(r"p plain: 2 answer\(s\) in \d+ s", lines[1]), lines
    assert lines[2] == "p logprobs: sending 2 request(s), 1 at a time"
    assert re.fullmatch(r"p logprobs: 2 answer\(s\) in \d+ s, 2 not ok", lines[3]), lines
    assert lines[4] == "p sequential: sending one request at a time for 0 s"
    assert re.fullmatch(r"p sequential: 1 answer\(s\) in \d+ s, 1 not ok", lines[5]), lines
    assert len(lines) == 6, lines
