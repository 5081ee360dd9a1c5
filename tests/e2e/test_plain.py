"""Requests without logprobs: token ids and prompt_embeds of every size, on every executor.

These run first in each profile: on the compiled-graph executor they are what
answers before the first logprobs request
(findings/cgraph-raylet-writeacquire).
"""

from __future__ import annotations

import pytest

from live.suite import MODEL_SPEC, SIZES, LiveCluster, Reference, bitexact, judge, timeouts
from vllm_zerocopy_testbed.workload.catalog import plain_specs
from vllm_zerocopy_testbed.workload.requests import Record

pytestmark = [pytest.mark.e2e, pytest.mark.suite("plain"), pytest.mark.timeout(1800)]

REPEATS = 2


@pytest.fixture(scope="session")
def plain_run(cluster: LiveCluster) -> list[Record]:
    return cluster.run("plain", plain_specs(SIZES, MODEL_SPEC) * REPEATS)


def test_every_request_answers_within_its_bound(cluster: LiveCluster, plain_run: list[Record]) -> None:
    judge(cluster, timeouts.check(plain_run))


def test_repeats_and_embeds_twins_give_the_same_text(cluster: LiveCluster, plain_run: list[Record]) -> None:
    answers = bitexact.first_answers(plain_run)
    embeds = [r for r in plain_run if r.key.startswith("plain/embeds/")]
    twins = {r.key: answers[r.key.replace("/embeds/", "/ids/")] for r in embeds
             if r.key.replace("/embeds/", "/ids/") in answers}
    judge(cluster, timeouts.check(plain_run), bitexact.check(plain_run, answers),
          bitexact.check(embeds, twins, name="embeds = token ids"))


def test_text_matches_the_single_process_reference(cluster: LiveCluster, plain_run: list[Record],
                                                   reference: Reference) -> None:
    judge(cluster, timeouts.check(plain_run), bitexact.check(plain_run, reference.answers, name="text = reference"))
