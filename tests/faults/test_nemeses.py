"""Nemeses during a stream of logprobs and prompt_embeds requests (``make faults``, either backend).

One test per nemesis, the Jepsen shape: the cluster, the workload (``Stream``, two clients),
the nemesis on its schedule (``nemesis.run``: lead, apply, hold, heal; events into the
history), the checkers (the bound from the recorded fault time, recovery, bit-exact after).
Figures per nemesis go to ``reports/<run>/faults.{json,md}`` (docs/faults.md).
"""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed import nemesis as nemeses
from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.cluster.recovery import answers, recover
from vllm_zerocopy_testbed.report import fault_row
from vllm_zerocopy_testbed.host_config import ClusterSettings
from vllm_zerocopy_testbed.workload.catalog import LARGE_STEP_BYTES, batched_tokens, large_step_specs, logprobs_specs
from vllm_zerocopy_testbed.workload.embeds import token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import HealthWatch, Stream
from live.suite import (FAULTS, HISTORY, PROFILES, REQUEST_TIMEOUT_S, SIZES, LiveCluster, bitexact, faults, judge,
                        timeline, timeouts)

pytestmark = [pytest.mark.faults, pytest.mark.suite("nemesis"), pytest.mark.timeout(1500)]

SELF_RECOVERY_S = 420.0  # head restart + warm-up on one core is ~3 min
LARGE_LEAD_S = 12.0


def _specs(workload: str, settings: ClusterSettings) -> list[CompletionSpec]:
    """What streams beside a nemesis (``Nemesis.workload``)."""
    if workload == "large":
        specs = large_step_specs(int(settings["TESTBED_MAX_NUM_SEQS"]), int(settings["TESTBED_MAX_MODEL_LEN"]))
        budget = settings.max_num_batched_tokens
        if budget is None or budget < batched_tokens(specs):
            pytest.skip(f"a >= 16 MiB scheduler step needs `--max-num-batched-tokens {batched_tokens(specs)}` or more "
                        f"in TESTBED_SERVE_ARGS (make faults sets it); the cluster has "
                        f"{settings['TESTBED_SERVE_ARGS']!r}")
        return specs
    ids = tuple(token_ids(SIZES.out_of_band, seed=11))
    return [*logprobs_specs(max_tokens=8)[:2],
            CompletionSpec("embeds/oob", embeds=(Embeds(ids),), max_tokens=8, logprobs=5)]


@pytest.mark.parametrize("nemesis", [pytest.param(n, marks=[pytest.mark.known(n.known)] if n.known else [])
                                     for n in nemeses.NEMESES], ids=str)
def test_requests_end_within_the_bound_and_the_cluster_comes_back(cluster: LiveCluster, nemesis, profile) -> None:
    if profile != PROFILES[0]:
        pytest.skip("nemeses run on the first profile only (each costs a cluster recovery)")
    backend, model = cluster.backend, cluster.settings["TESTBED_SERVED_MODEL"]
    lacking = nemesis.cannot(backend)
    if lacking:
        pytest.skip(lacking)
    specs = _specs(nemesis.workload, cluster.settings)
    if not (backend.is_running() and answers(backend.base_url, model)):
        backend.up()  # an earlier nemesis left it down: start from a healthy cluster
    runner = Runner(backend.base_url, model, HISTORY, str(profile), REQUEST_TIMEOUT_S)
    before = runner.run("nemesis-before", specs)
    assert all(r.ok for r in before), f"the cluster did not answer before the fault: {timeouts.check(before)}"

    stream = Stream(runner, specs)
    # A large step takes seconds: let the two clients reach the steps that carry both batches' tensors.
    schedule = nemeses.Schedule(lead_s=LARGE_LEAD_S if nemesis.workload == "large" else nemeses.Schedule.lead_s)
    with HealthWatch(backend.base_url.removesuffix("/v1")) as health:
        fault = nemeses.run(backend, nemesis, stream, HISTORY, str(profile), schedule, join_s=REQUEST_TIMEOUT_S + 30)
    bound = faults.check(stream.records, HISTORY.events(profile=str(profile), kind=nemesis.name), nemeses.BOUND_S)
    note, precondition = _large_steps(cluster) if nemesis.workload == "large" else ("", None)
    recovery = recover(backend, model, self_recovery_s=SELF_RECOVERY_S)
    after = runner.run("nemesis-after", specs)
    same = bitexact.check(after, bitexact.first_answers(before))

    FAULTS.append(fault_row(nemesis.name, nemesis.what, type(backend).__name__, bound, stream.records, fault.at,
                            health.unhealthy_after(fault.at), recovery.how, recovery.seconds,
                            same.ok and all(r.ok for r in after), profile=str(profile), note=note))
    unharmed = _unharmed(cluster, stream.records) if nemesis.harmless else None
    judge(cluster, bound, timeouts.check(after), same, *(v for v in (precondition, unharmed) if v))


def _unharmed(cluster: LiveCluster, records: list) -> Verdict:
    """A nemesis whose nodes stay up (``Nemesis.harmless``) may cost time, never an answer; where
    the engine died, its fatal line is quoted (a known failure matches by it)."""
    verdict = Verdict("unharmed")
    failed = [r for r in records if not r.ok]
    if failed:
        fatal = next((line.strip() for line in cluster.backend.logs().splitlines() if "Fatal Python error" in line),
                     "no fatal error in the logs")
        verdict.fail(f"{len(failed)} of {len(records)} requests failed although every node stayed up "
                     f"(first: {failed[0].key}: {(failed[0].error or '')[:160]}); the engine: {fatal}")
    return verdict


def _large_steps(cluster: LiveCluster) -> tuple[str, Verdict | None]:
    """Whether the stream really sent >= 16 MiB steps to the worker node: the engine's MessageQueue
    timeline (TESTBED_MQ_TIMELINE=1, which make faults sets) has every out-of-band frame it sent."""
    if cluster.settings.values.get("TESTBED_MQ_TIMELINE") != "1" or cluster.backend.blind_to("engine-log"):
        return "step sizes not seen (TESTBED_MQ_TIMELINE=0)", None
    figures = timeline.path_figures(cluster.backend.logs())
    largest = int(figures["largest_bytes"])
    note = (f"largest step sent to the worker node {largest / 2**20:.1f} MiB; of {figures['frames']:.0f} frames "
            f"to it, {figures['unreleased']:.0f} never released by ZMQ, the longest held {figures['held_ms_max']:.0f} ms "
            "(MessageQueue timeline)")
    verdict = Verdict("large-steps", figures={"largest_mib": largest / 2**20})
    if largest < LARGE_STEP_BYTES:
        verdict.fail(f"no step of >= {LARGE_STEP_BYTES >> 20} MiB reached the worker node (largest "
                     f"{largest / 2**20:.1f} MiB): the nemesis did not run beside what it names")
    return note, verdict
