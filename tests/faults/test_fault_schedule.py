"""A seeded fault schedule while the workload streams (``make faults SCHEDULE=random SEED=n DURATION=10m``).

The Jepsen shape: the cluster, the workload (``Stream``, two clients), the nemesis client fed by
the schedule (``schedule.run``: kill, pause, isolate, slow link, restart, GCS kill, overlapping
where safe), the checkers over what was recorded (``checker/schedule.py``). The schedule goes to
``reports/<run>/schedule.json`` before it runs (``TESTBED_SCHEDULE_FILE=`` that file replays it);
the whole run to ``schedule-run.json``, which ``python -m vllm_zerocopy_testbed.checker.schedule
reports/<run>`` judges again offline. Skipped unless ``TESTBED_SCHEDULE=random`` or a schedule
file is named, so plain ``make faults`` runs what it ran.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vllm_zerocopy_testbed import nemesis as nemeses
from vllm_zerocopy_testbed import schedule as schedules
from vllm_zerocopy_testbed.checker.bitexact import first_answers
from vllm_zerocopy_testbed.checker.faults import ended_at
from vllm_zerocopy_testbed.cluster.interface import Unsupported
from vllm_zerocopy_testbed.cluster.local_vllm import LocalVllmCluster
from vllm_zerocopy_testbed.cluster.recovery import answers, recover
from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.report import fault_row
from vllm_zerocopy_testbed.workload.catalog import logprobs_specs
from vllm_zerocopy_testbed.workload.embeds import token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds, Record
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import HealthWatch, Stream
from live.suite import (FAULTS, HISTORY, PROFILES, REQUEST_TIMEOUT_S, RUN_DIR, SIZES, LiveCluster, Reference, judge,
                        match_reference, schedule as checks, timeouts)

WANTED = os.environ.get(schedules.SCHEDULE_ENV, "").strip() == "random" or bool(
    os.environ.get(schedules.SCHEDULE_FILE_ENV, "").strip())

# The run's own length is DURATION; this covers the cluster's start and the recovery after it.
pytestmark = [pytest.mark.faults, pytest.mark.suite("nemesis"), pytest.mark.timeout(4 * 3600),
              pytest.mark.skipif(not WANTED, reason="a fault schedule runs with make faults SCHEDULE=random "
                                                    "(TESTBED_SCHEDULE=random) or TESTBED_SCHEDULE_FILE=<schedule.json>")]

# A lost node is back by itself in 26-90 s on compose (docs/faults.md), a restarted head with its
# warm-up in up to ~3 min; the schedule's quiet tail is longer.
RECOVERY_S = 180.0
SELF_RECOVERY_S = 420.0  # after the run: head restart + warm-up on one core is ~3 min


def _specs() -> list[CompletionSpec]:
    """The nemeses' mixed workload: logprobs k=1, k=2 and a 1 MiB prompt_embeds with logprobs=5."""
    ids = tuple(token_ids(SIZES.out_of_band, seed=11))
    return [*logprobs_specs(max_tokens=8)[:2],
            CompletionSpec("embeds/oob", embeds=(Embeds(ids),), max_tokens=8, logprobs=5)]


def test_a_fault_schedule_keeps_every_request_bounded_and_the_cluster_comes_back(
        cluster: LiveCluster, reference: Reference, profile) -> None:
    if profile != PROFILES[0]:
        pytest.skip("the schedule runs on the first profile only")
    backend, model = cluster.backend, cluster.settings["TESTBED_SERVED_MODEL"]
    if not backend.owned:
        pytest.skip("an external cluster is observed, never hurt")
    if isinstance(backend, LocalVllmCluster):
        pytest.skip("nothing restarts a local node (no restart policy): after the first node loss the schedule "
                    "would judge the backend, not vLLM; TESTBED_CLUSTER=compose")
    schedule, path, _ = schedules.from_env(backend, os.environ, RUN_DIR)
    if not schedule.ops:
        pytest.skip(f"the schedule holds no fault ({path})")

    if not (backend.is_running() and answers(backend.base_url, model)):
        backend.up()  # an earlier nemesis left it down: start from a healthy cluster
    runner = Runner(backend.base_url, model, HISTORY, str(profile), REQUEST_TIMEOUT_S)
    specs = _specs()
    # The session's reference answered the suites' specs; these (8 tokens, the 1 MiB embeds) it answers here.
    assert reference.runner is not None, "the reference server is down"
    ours = reference.runner.run("schedule-reference", specs)
    assert all(r.ok for r in ours), f"the single-process reference failed: {timeouts.check(ours)}"
    before = runner.run("schedule-before", specs)
    assert all(r.ok for r in before), f"the cluster did not answer before the schedule: {timeouts.check(before)}"

    stream = Stream(runner, specs, suite="schedule")
    with HealthWatch(backend.base_url.removesuffix("/v1")) as health:
        started = time.time()
        stream.stop(started + schedule.duration_s)
        stream.start()
        running = schedules.run(backend, schedule, HISTORY, str(profile), started=started)
        try:
            ended = running.follow(schedule.duration_s + 600)  # every step is bounded (docker calls: 30-60 s)
        finally:
            running.stop.set()  # past the join or on an interrupt: heal what was applied, apply nothing more
            running.join(300)
        stream.join(max(0.0, running.ends_at - time.time()) + REQUEST_TIMEOUT_S + 30)
    assert ended, f"the schedule's steps did not end within {schedule.duration_s + 600:.0f} s: {running.steps[-1:]}"

    states = {}
    for node in backend.nodes():
        try:
            states[node] = backend.state(node)
        except (Unsupported, LookupError) as exc:
            states[node] = f"unknown ({exc})"
    recovery = recover(backend, model, self_recovery_s=SELF_RECOVERY_S)
    after = runner.run("schedule-after", specs)

    data = {"schedule": schedule.to_json(), "profile": str(profile), "backend": type(backend).__name__,
            "started": started, "ends_at": running.ends_at, "bound_s": nemeses.BOUND_S,
            "recovery_bound_s": RECOVERY_S, "steps": [s.to_json() for s in running.steps],
            "records": [r.to_json() for r in stream.records], "before": [r.to_json() for r in before],
            "after": [r.to_json() for r in after], "states": states, "leftovers": [],
            "recovered_after_run": {"how": recovery.how, "seconds": recovery.seconds, "why": recovery.why}}
    (RUN_DIR / checks.RUN_FILE).write_text(json.dumps(data, indent=1) + "\n")
    verdicts = checks.check_run(data)
    _row(schedule, data, verdicts, health)
    judge(cluster, *verdicts, timeouts.check(after), *match_reference(before, Reference(first_answers(ours), ours)))


def _row(schedule: schedules.Schedule, data: dict, verdicts: list, health: HealthWatch) -> None:
    """The run's line in faults.json / faults.md (the figures docs/faults.md quotes); its times are
    seconds after the first fault."""
    by = {v.checker: v for v in verdicts}
    bound, recovered = by["schedule-bound"], by["recovery"]
    records = [Record(**r) for r in data["records"]]
    first_at = min((s["started"] for s in data["steps"] if s["phase"] == "apply"), default=data["started"])
    bound.figures["first_error_s"] = min((ended_at(r) - first_at for r in records if not r.ok), default=-1.0)
    bound.figures["last_end_s"] = max((ended_at(r) for r in records), default=first_at) - first_at
    kinds = ", ".join(f"{k} {sum(op.kind == k for op in schedule.ops)}" for k in schedule.kinds
                      if any(op.kind == k for op in schedule.ops))
    steps = by["schedule-ran"].figures
    note = (f"{len(schedule.ops)} faults over {schedule.duration_s:.0f} s ({kinds}); {steps['failed_applies']:.0f} "
            f"apply(s) and {steps['failed_steps'] - steps['failed_applies']:.0f} heal(s) failed; "
            f"{sum(r.status == 'timeout' for r in records)} hang(s); every verdict: "
            f"{', '.join(f'{v.checker} ' + ('ok' if v.ok else 'RED') for v in verdicts)}; replay: "
            f"make faults SCHEDULE_FILE={_shown(RUN_DIR / 'schedule.json')}")
    FAULTS.append(fault_row(f"schedule seed={schedule.seed}", "a seeded fault schedule (schedule.py)", data["backend"],
                            bound, records, first_at, health.unhealthy_after(first_at),
                            f"{recovered.figures['recovered']:.0f} of {recovered.figures['faults']:.0f} faults, "
                            "the longest", float(recovered.figures["max_recovery_s"]),
                            by["bit-exact after recovery"].ok, profile=data["profile"], note=note))


def _shown(path: Path) -> str:
    """``path`` from the repository root where it lies under it (what one types after ``make``)."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
