"""prompt_embeds through the cluster: every transport path, dtype and a batch; checkers over one run.

Sizes (fp32 on the wire, the server casts every dtype): ``small`` stays in the
ring and in band, ``oob`` is just over the 1 MiB out-of-band limit, ``overflow``
is past the MessageQueue ring chunk (``VLLM_MQ_MAX_CHUNK_BYTES_MB``) and goes
through the overflow socket. The V2 executor broadcasts them to the remote
stage over ZMQ TCP, which is where zero-copy and the send race live.
"""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.config import Executor
from live.suite import (MODEL_SPEC, SIZES, LiveCluster, Reference, bitexact, judge, match_reference, timeouts,
                        transport, within_budget)
from vllm_zerocopy_testbed.workload.catalog import embeds_batch_specs, embeds_specs
from vllm_zerocopy_testbed.workload.requests import Record

# every embeds request asks for logprobs
pytestmark = [pytest.mark.e2e, pytest.mark.suite("embeds"), pytest.mark.known("cgraph_logprobs"),
              pytest.mark.timeout(1800)]

REPEATS = 2


@pytest.fixture(scope="session")
def embeds_run(cluster: LiveCluster, reference: Reference) -> list[Record]:
    """The embeds workload, sent ``REPEATS`` times, one request at a time."""
    specs = [*embeds_specs(SIZES, spec=MODEL_SPEC), *embeds_batch_specs(spec=MODEL_SPEC)]
    return cluster.run("embeds", specs * REPEATS, paired=reference)


def test_every_request_answers_within_its_bound(cluster: LiveCluster, embeds_run: list[Record]) -> None:
    judge(cluster, timeouts.check(embeds_run))


def test_repeats_are_bit_exact(cluster: LiveCluster, embeds_run: list[Record]) -> None:
    judge(cluster, timeouts.check(embeds_run), bitexact.check(embeds_run, bitexact.first_answers(embeds_run)))


def test_embeds_of_token_rows_answer_as_the_token_ids(cluster: LiveCluster, embeds_run: list[Record]) -> None:
    """fp32 rows of the model's own embedding table must give exactly the token-id prompt's answer."""
    answers = bitexact.first_answers(embeds_run)
    fp32 = [r for r in embeds_run if r.key.startswith("embeds/float32/")]
    twins = {r.key: answers[r.key.replace("embeds/float32/", "ids/")] for r in fp32
             if r.key.replace("embeds/float32/", "ids/") in answers}
    judge(cluster, timeouts.check(embeds_run), bitexact.check(fp32, twins, name="embeds = token ids"))


def test_batch_of_embeds_answers_as_each_alone(cluster: LiveCluster, embeds_run: list[Record]) -> None:
    answers = bitexact.first_answers(embeds_run)
    batch = answers.get("embeds/batch")
    if batch is None:  # judged with the failed requests and the server's evidence (known failures match on it)
        missing = Verdict("batch = parts")
        missing.fail("the batch request got no answer")
        judge(cluster, timeouts.check(embeds_run), missing)
    verdict = Verdict("batch = parts")
    for n, choice in enumerate(batch.choices):
        alone = answers[f"ids/batch/{n}"]
        single = Record(key=f"ids/batch/{n}", suite="", profile="", bound_s=0, choices=[choice])
        for difference in bitexact.differences(alone, single):
            verdict.fail(f"part {n}: {difference}")
    judge(cluster, verdict)


def test_tokens_match_the_single_process_reference(cluster: LiveCluster, embeds_run: list[Record],
                                                   reference: Reference) -> None:
    """Tokens identical; logprobs within 1e-5: TP=2 sums fp32 partials in another order than TP=1."""
    judge(cluster, timeouts.check(embeds_run), *match_reference(embeds_run, reference))


def test_latency_is_within_budget_of_the_reference(cluster: LiveCluster, embeds_run: list[Record]) -> None:
    """Each request against the reference sent just before it: no slowdown past the budget, no stall."""
    judge(cluster, timeouts.check(embeds_run), within_budget(cluster, embeds_run))


@pytest.mark.known("zero_copy")
@pytest.mark.parametrize("size", ["oob", "overflow"])
def test_large_embeds_cross_to_the_remote_stage_out_of_band(cluster: LiveCluster, size: str,
                                                            request: pytest.FixtureRequest) -> None:
    """The tensor leaves the engine as a ZMQ frame of its own (PR 48442), not inside the pickle stream."""
    if cluster.profile.executor is not Executor.V2:
        pytest.skip("the compiled-graph executor has no MessageQueue broadcast")
    blind = cluster.backend.blind_to("engine-log")
    if blind:
        pytest.skip(blind)
    embeds_run: list[Record] = request.getfixturevalue("embeds_run")  # after the skips: it costs ~90 s
    rows = dict(SIZES.items())[size]
    assert any(r.ok and r.key == f"embeds/float32/{size}" for r in embeds_run), "the request got no answer"
    judge(cluster, transport.check_out_of_band(cluster.backend.logs(), rows * 512, path="remote"))
