"""logprobs through the cluster: k = 1..20, prompt_logprobs, streaming, concurrency, a long sequence, a restart.

On the compiled-graph executor these are the requests whose outputs carry numpy
arrays through Ray's channels (the detach path, vLLM#35319) — and whose first
one stalls past ``RAY_CGRAPH_get_timeout`` without the testbed's fix (findings/cgraph-raylet-writeacquire).
"""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.config import Executor
from vllm_zerocopy_testbed.known import E2E
from live.suite import (MODES_CHOSEN, PROFILES, LiveCluster, Reference, bitexact, judge, match_reference, timeouts,
                        within_budget)
from vllm_zerocopy_testbed.workload.catalog import (LOGPROBS_KS, concurrent_count, concurrent_specs, logprobs_specs,
                                                    prompt_logprobs_specs, stream_specs)
from vllm_zerocopy_testbed.workload.requests import Record

pytestmark = [pytest.mark.e2e, pytest.mark.known("cgraph_logprobs"), pytest.mark.timeout(1800)]

REPEATS = 2


@pytest.fixture(scope="session")
def logprobs_run(cluster: LiveCluster, reference: Reference) -> list[Record]:
    """k = 1..20, prompt_logprobs and a streamed request, ``REPEATS`` times, one at a time."""
    specs = [*logprobs_specs(), *prompt_logprobs_specs(), *stream_specs()]
    return cluster.run("logprobs", specs * REPEATS, paired=reference)


@pytest.fixture(scope="session")
def concurrent_run(cluster: LiveCluster, logprobs_run: list[Record]) -> list[Record]:
    """Twice ``--max-num-seqs`` distinct requests in flight at once (the scheduler queues the rest), at
    most 16 (``catalog.concurrent_count``: with ``make e2e``'s 128 sequences they all run together)."""
    count = concurrent_count(int(cluster.settings["TESTBED_MAX_NUM_SEQS"]))
    return cluster.run("concurrent", concurrent_specs(count), concurrency=count)


@pytest.mark.suite("logprobs")
def test_every_request_answers_within_its_bound(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    judge(cluster, timeouts.check(logprobs_run))


@pytest.mark.suite("logprobs")
def test_each_position_has_k_logprobs(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    """--return-tokens-as-token-ids keeps all k alternatives (text keys collide on byte fragments)."""
    verdict = Verdict("k logprobs per position")
    for record in logprobs_run:
        k = next((k for k in LOGPROBS_KS if record.key == f"logprobs/k{k}"), None)
        if record.ok and k is not None:
            sizes = {len(top) for top in record.choices[0]["top_logprobs"]}
            # the sampled token is added when it is not among the top k
            if not sizes <= {k, k + 1}:
                verdict.fail(f"{record.key}: {sorted(sizes)} entries per position")
    judge(cluster, timeouts.check(logprobs_run), verdict)


@pytest.mark.suite("logprobs")
def test_repeats_are_bit_exact(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    judge(cluster, timeouts.check(logprobs_run), bitexact.check(logprobs_run, bitexact.first_answers(logprobs_run)))


@pytest.mark.suite("logprobs")
def test_streamed_answer_equals_the_whole_one(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    answers = bitexact.first_answers(logprobs_run)
    streamed = [r for r in logprobs_run if r.key == "stream/k5"]
    as_whole = {"stream/k5": answers["logprobs/k5"]} if "logprobs/k5" in answers else {}
    judge(cluster, timeouts.check(logprobs_run), bitexact.check(streamed, as_whole, name="stream = whole"))


@pytest.mark.suite("logprobs")
def test_prompt_logprobs_are_returned(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    """prompt_logprobs (not covered by upstream's detach) reach the client, one entry per prompt token."""
    verdict = Verdict("prompt_logprobs")
    records = [r for r in logprobs_run if r.key.startswith("prompt-logprobs/") and r.ok]
    if not records:
        verdict.fail("no prompt_logprobs request was answered")
    for record in records:
        entries = record.choices[0].get("prompt_logprobs")
        if not entries or entries[0] is not None or len(entries) != 12:
            verdict.fail(f"{record.key}: {len(entries or [])} entries (want 12, the first None)")
    judge(cluster, timeouts.check(logprobs_run), verdict)


@pytest.mark.suite("logprobs")
def test_answers_match_the_single_process_reference(cluster: LiveCluster, logprobs_run: list[Record],
                                                    reference: Reference) -> None:
    """Tokens identical; logprobs within 1e-5: TP=2 sums fp32 partials in another order than TP=1."""
    judge(cluster, timeouts.check(logprobs_run), *match_reference(logprobs_run, reference))


@pytest.mark.suite("logprobs")
def test_latency_is_within_budget_of_the_reference(cluster: LiveCluster, logprobs_run: list[Record]) -> None:
    """Each request against the reference sent just before it: no slowdown past the budget, no stall."""
    judge(cluster, timeouts.check(logprobs_run), within_budget(cluster, logprobs_run))


@pytest.mark.suite("concurrent")
def test_concurrent_requests_all_answer_as_alone(cluster: LiveCluster, concurrent_run: list[Record],
                                                 reference: Reference) -> None:
    """More requests than --max-num-seqs at once: all answer, with the tokens they get alone."""
    judge(cluster, timeouts.check(concurrent_run), *match_reference(concurrent_run, reference))


@pytest.mark.suite("sequential")
def test_a_sequence_longer_than_the_channel_timeout_never_stalls(cluster: LiveCluster,
                                                                 logprobs_run: list[Record]) -> None:
    """Outputs held across steps block the next channel read until RAY_CGRAPH_get_timeout (vLLM#35319).

    Requests one after another for longer than that timeout: every one answers
    within its bound and equals the first answer of its kind. Only where there is such a
    channel: on V2 it cannot fail, and it would cost a minute a profile.
    """
    if cluster.profile.executor is not Executor.CGRAPH:
        pytest.skip("RayExecutorV2 has no compiled-graph channel to time out: the cgraph profiles run this")
    seconds = float(cluster.settings.values.get("RAY_CGRAPH_get_timeout", "60")) + 5
    records = cluster.run("sequential", logprobs_specs(), seconds=seconds)
    judge(cluster, timeouts.check(records), bitexact.check(records, bitexact.first_answers(logprobs_run)))


def restart_shown_across(profile) -> str | None:
    """Name the profile of this run whose answers already show what a restart would: another one on
    the same executor (a cluster start of its own, its logprobs compared bit for bit with ``profile``'s
    by ``across``), not known to die at its first logprobs request; None if there is none."""
    for other in PROFILES:
        if other != profile and other.executor == profile.executor and (
                MODES_CHOSEN or E2E["cgraph_logprobs"].reason_on(other) is None):
            return str(other)
    return None


@pytest.mark.slow
@pytest.mark.suite("restart")
def test_answers_survive_a_restart(cluster: LiveCluster, profile, request: pytest.FixtureRequest) -> None:
    """The same requests after the cluster went down and up again: bit-exact (first profile only,
    and only where no other profile of the run shows it: a restart costs a cluster start)."""
    if profile != PROFILES[0]:
        pytest.skip("one restart per run (the first profile's)")
    shown_by = restart_shown_across(profile)
    if shown_by:
        pytest.skip(f"{shown_by} answers the same logprobs requests on a cluster started afresh, compared bit "
                    "for bit by the across suite")
    if not cluster.backend.owned:
        pytest.skip("an external cluster is never brought down")
    logprobs_run: list[Record] = request.getfixturevalue("logprobs_run")
    if cluster.dead:
        pytest.fail(f"not run: {cluster.dead}")
    cluster.backend.down()
    cluster.backend.up()
    records = cluster.run("restart", [*logprobs_specs(), *prompt_logprobs_specs()])
    judge(cluster, timeouts.check(records), bitexact.check(records, bitexact.first_answers(logprobs_run)))
