"""Nemeses during a stream of logprobs and prompt_embeds requests (``make faults``, either backend).

One test per nemesis, the Jepsen shape: the cluster, the workload (``Stream``, two clients),
the nemesis on its schedule (``nemesis.run``: lead, apply, hold, heal; events into the
history), the checkers (the bound from the recorded fault time, recovery, bit-exact after).
Figures per nemesis go to ``reports/<run>/faults.{json,md}`` (docs/faults.md).
"""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed import nemesis as nemeses
from vllm_zerocopy_testbed.checker import bitexact, faults, timeouts
from vllm_zerocopy_testbed.cluster.recovery import answers, recover
from vllm_zerocopy_testbed.report import fault_row
from vllm_zerocopy_testbed.workload.catalog import logprobs_specs
from vllm_zerocopy_testbed.workload.embeds import token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import HealthWatch, Stream
from live.suite import FAULTS, HISTORY, PROFILES, REQUEST_TIMEOUT_S, SIZES, LiveCluster, judge

pytestmark = [pytest.mark.faults, pytest.mark.suite("nemesis"), pytest.mark.timeout(1500)]

SELF_RECOVERY_S = 420.0  # head restart + warm-up on one core is ~3 min


def _specs() -> list[CompletionSpec]:
    ids = tuple(token_ids(SIZES.out_of_band, seed=11))
    return [*logprobs_specs(max_tokens=8)[:2],
            CompletionSpec("embeds/oob", embeds=(Embeds(ids),), max_tokens=8, logprobs=5)]


@pytest.mark.parametrize("nemesis", nemeses.NEMESES, ids=str)
def test_requests_end_within_the_bound_and_the_cluster_comes_back(cluster: LiveCluster, nemesis, profile) -> None:
    if profile != PROFILES[0]:
        pytest.skip("nemeses run on the first profile only (each costs a cluster recovery)")
    backend, model, specs = cluster.backend, cluster.settings["TESTBED_SERVED_MODEL"], _specs()
    lacking = nemesis.cannot(backend)
    if lacking:
        pytest.skip(lacking)
    if not (backend.is_running() and answers(backend.base_url, model)):
        backend.up()  # an earlier nemesis left it down: start from a healthy cluster
    runner = Runner(backend.base_url, model, HISTORY, str(profile), REQUEST_TIMEOUT_S)
    before = runner.run("nemesis-before", specs)
    assert all(r.ok for r in before), f"the cluster did not answer before the fault: {timeouts.check(before)}"

    stream = Stream(runner, specs)
    with HealthWatch(backend.base_url.removesuffix("/v1")) as health:
        fault = nemeses.run(backend, nemesis, stream, HISTORY, str(profile), join_s=REQUEST_TIMEOUT_S + 30)
    bound = faults.check(stream.records, HISTORY.events(profile=str(profile), kind=nemesis.name), nemeses.BOUND_S)
    recovery = recover(backend, model, self_recovery_s=SELF_RECOVERY_S)
    after = runner.run("nemesis-after", specs)
    same = bitexact.check(after, bitexact.first_answers(before))

    FAULTS.append(fault_row(nemesis.name, nemesis.what, type(backend).__name__, bound, stream.records, fault.at,
                            health.unhealthy_after(fault.at), recovery.how, recovery.seconds,
                            same.ok and all(r.ok for r in after)))
    judge(cluster, bound, timeouts.check(after), same)
