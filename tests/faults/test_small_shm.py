"""A small /dev/shm (``TESTBED_SHM_SIZE``, compose ``shm_size``): what a user with Docker's default gets.

Each case starts a compose cluster of its own with the size and settings, bounded, and judges what
it did (``faults/small_shm.py``): served with every answer equal to the single-process reference, or
refused at start with an error that names /dev/shm and the fix, is green; a crash or a hang after it
started, or a start that fails without saying so, is red. The sizes follow from vLLM's check and the
head's rings (``small_shm.head_segments``): Docker's 64 MiB, the smallest round size upstream's
checks accept (256 MiB: one 240 MiB response ring at a time), the same under ``testbed`` (whose
rings reserve their pages: all of them at once), and the smallest round size ``testbed`` accepts
(528 MiB). Each case runs on a compose instance of its own. The arena case serves the head with vLLM's
multiprocessing executor (``--enable-shm-tensor-arena`` is used there only) on the default 2 GiB,
which is smaller than the arena's 8 x 256 MiB and their flag bytes. Each start is a few minutes on
this machine; the outcomes and their first error lines go to the run's notes (docs/faults.md,
"Small /dev/shm").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import pytest

from vllm_zerocopy_testbed.checker import bitexact
from vllm_zerocopy_testbed.cluster.interface import Cluster, ClusterStartError
from vllm_zerocopy_testbed.cluster.reference import ReferenceServer
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.host_config import ClusterSettings, cluster_backend
from vllm_zerocopy_testbed.workload.catalog import plain_specs
from vllm_zerocopy_testbed.workload.requests import History, Record
from vllm_zerocopy_testbed.workload.runner import Runner
from faults.small_shm import (MIB, Judgement, Outcome, first_refused, head_segments, judge, refused_at_start,
                              smallest_accepted)
from live.suite import MODEL_SPEC, REPORT, REQUEST_TIMEOUT_S, SETTINGS, SIZES

pytestmark = [pytest.mark.faults, pytest.mark.suite("small-shm"), pytest.mark.timeout(1800)]

logger = logging.getLogger(__name__)

# Token ids and fp32 embeds through the ring, out of band and past the chunk: every path the rings carry.
SPECS = plain_specs(SIZES, MODEL_SPEC)
UP_TIMEOUT_S = 900.0  # a refused start is two head starts (one restart)
# Every path's mode, as a profile sets them.
MODES = ("TESTBED_BROADCAST", "TESTBED_DETACH", "TESTBED_INFLIGHT", "TESTBED_ARENA")
# The head's vLLM on its own, TP ranks over one process each (the arena's home); the last flag wins.
MP_ARENA_ARGS = "--distributed-executor-backend mp --pipeline-parallel-size 1 --enable-shm-tensor-arena"


@dataclass(frozen=True)
class Case:
    """One start: a /dev/shm size and the settings beside it."""

    name: str
    shm_size: str  # compose's shm_size
    mode: str  # every path's mode
    serve_args: str = ""
    what: str = ""

    def overrides(self) -> dict[str, str]:
        """The settings this case starts with: one head restart at most (a refused start is not retried
        for minutes), room for the nodes to join on a loaded machine, the size, the modes, the flags."""
        values = {"TESTBED_SHM_SIZE": self.shm_size, "TESTBED_RESTARTS": "1", "TESTBED_NODES_WAIT_S": "300",
                  **{m: self.mode for m in MODES}}
        if self.serve_args:
            values["TESTBED_SERVE_ARGS"] = self.serve_args
        return values


CASES = [
    Case("64m-defaults", "64m", "testbed", what="Docker's default size, compose/.env otherwise (testbed modes)"),
    Case("64m-upstream", "64m", "upstream", what="Docker's default size, the installed vLLM untouched"),
    Case("256m-upstream", "256m", "upstream", what="the smallest round size upstream's checks accept"),
    Case("256m-testbed", "256m", "testbed", what="the same size under testbed (rings reserved)"),
    Case("528m-testbed", "528m", "testbed", what="the smallest round size testbed's reserved rings leave room in"),
    Case("2gb-arena-mp", "2gb", "upstream", serve_args=MP_ARENA_ARGS,
         what="the arena on (multiprocessing executor, TP=2 in the head), the default 2 GiB: below 8 x 256 MiB"),
]


@dataclass
class Run:
    """What one start did."""

    case: Case
    judgement: Judgement
    seconds: float
    predicted: str
    records: list[Record] = field(default_factory=list)


def _settings(case: Case) -> ClusterSettings:
    """The case's settings on a compose instance of its own (the next one): under ``make faults`` the
    session's cluster holds the run's instance, and its lock is this process's already."""
    settings = ClusterSettings.from_env(process_env(**case.overrides()))
    return settings.for_instance(settings.instance + 1)


def predicted(case: Case, settings: ClusterSettings) -> str:
    """What vLLM's checks refuse first on the head at this size, by the ring sizes (nothing used before)."""
    executor = "mp" if "--distributed-executor-backend mp" in case.serve_args else "ray"
    local = int(settings["TESTBED_TP"]) if executor == "mp" else int(settings["TESTBED_HPU_PER_NODE"])
    segments = head_segments(local, int(settings["VLLM_MQ_MAX_CHUNK_BYTES_MB"]), executor=executor,
                             arena="--enable-shm-tensor-arena" in case.serve_args)
    reserved = case.mode == "testbed"
    size = settings_bytes(case.shm_size)
    refused = first_refused(size, segments, reserved=reserved)
    need = smallest_accepted(segments, reserved=reserved)
    return (f"refuses the {refused.name} ({refused.size / MIB:.0f} MiB)" if refused else "accepted") + \
        f"; needs >= {need / MIB:.1f} MiB"


def settings_bytes(size: str) -> int:
    """Bytes of a compose size (``64m``, ``2gb``, a number)."""
    size = size.strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": MIB, "g": 1 << 30}
    return int(float(size[:-1]) * units[size[-1]]) if size[-1] in units else int(size)


@pytest.fixture(scope="module")
def reference_answers() -> Iterator[dict[str, Record]]:
    """The single-process reference's answers to ``SPECS`` (started only for a case that served)."""
    with ReferenceServer(SETTINGS) as server:
        runner = Runner(server.base_url, SETTINGS["TESTBED_SERVED_MODEL"], History(), "reference", REQUEST_TIMEOUT_S)
        records = runner.run("small-shm-reference", SPECS)
    assert all(r.ok for r in records), f"the reference did not answer: {[r.error for r in records if not r.ok]}"
    yield bitexact.first_answers(records)


def start(case: Case) -> Run:
    """Start the case's cluster (bounded), send ``SPECS`` one at a time and all at once if it started,
    keep its logs, bring it down; judge (its answers against the reference: in the test, once down)."""
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster

    settings = _settings(case)
    cluster = ComposeCluster(settings, up_timeout=UP_TIMEOUT_S)
    began = time.monotonic()
    started, records, timed_out = False, [], False
    try:
        started = _up_unless_refused(cluster, case)
        if started:
            runner = Runner(cluster.base_url, settings["TESTBED_SERVED_MODEL"], History(), case.name,
                            REQUEST_TIMEOUT_S)
            records = runner.run("small-shm", SPECS) + runner.run("small-shm", SPECS, concurrency=len(SPECS))
            timed_out = any(r.status == "timeout" for r in records)
        logs = cluster.logs()
    finally:
        cluster.down()
    left = cluster.leftovers()
    assert not left, f"{case.name}: the cluster left behind after down: {left}"
    answered = all(r.ok for r in records) if started else None
    judgement = judge(started=started, logs=logs, answered=answered, timed_out=timed_out, bitexact=True)
    return Run(case, judgement, time.monotonic() - began, predicted(case, settings), records)


def _up_unless_refused(cluster: Cluster, case: Case, poll_s: float = 10.0) -> bool:
    """Start the cluster (bounded); False as soon as the head's logs say its engine refused to start:
    its restart would take minutes to say the same again. The start's own wait, in its thread, ends
    when ``down`` has removed what it inspects."""
    result: dict[str, bool] = {}

    def up() -> None:
        try:
            cluster.up()
            result["started"] = True
        except (ClusterStartError, RuntimeError, TimeoutError) as exc:
            # RuntimeError: a docker command on what ``down`` removed meanwhile ends this wait
            logger.info("%s did not start: %s", case.name, str(exc).splitlines()[0])
            result["started"] = False

    thread = threading.Thread(target=up, name=f"small-shm-up-{case.name}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        if thread.is_alive() and refused_at_start(cluster.logs("head")):
            time.sleep(poll_s)  # the root cause's lines follow "EngineCore failed to start"
            return False
    return result.get("started", False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_small_shm_serves_or_refuses_at_start(case: Case, request: pytest.FixtureRequest) -> None:
    if cluster_backend() != "compose":
        pytest.skip("sets each node container's /dev/shm (compose shm_size); the local backend's nodes share "
                    "this machine's")
    run = start(case)
    judgement = run.judgement
    if judgement.green and run.records:
        expected = request.getfixturevalue("reference_answers")
        verdict = bitexact.check(run.records, expected, name="bit-exact vs the single-process reference")
        if not verdict.ok:
            judgement = Judgement(Outcome.WRONG, str(verdict))
    line = (f"small-shm `{case.name}` ({case.what}): {judgement.outcome.value} in {run.seconds:.0f} s; "
            f"predicted: {run.predicted}; first error: {judgement.first_error or 'none'}")
    REPORT.notes.append(line)
    print(line)
    assert judgement.green, line
