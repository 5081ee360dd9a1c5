"""Bad input on the live cluster: a 4xx with a message, a healthy server, and the next answer unchanged.

A 5xx or a dead server is a finding (possibly a vLLM bug worth reporting): the
test goes red and the report lists the answer.
"""

from __future__ import annotations

import pytest

from live.suite import MODEL_SPEC, REPORT, REQUEST_TIMEOUT_S, SETTINGS, SIZES, LiveCluster, bitexact, judge, timeouts
from vllm_zerocopy_testbed.workload import bad_input
from vllm_zerocopy_testbed.workload.catalog import plain_specs
from vllm_zerocopy_testbed.workload.requests import Record

pytestmark = [pytest.mark.faults, pytest.mark.suite("bad-input"), pytest.mark.timeout(900)]

# Without logprobs, so that the check also runs on the compiled-graph executor, whose first
# logprobs request deadlocks without the testbed's fix (findings/cgraph-raylet-writeacquire).
_VALID = plain_specs(SIZES, MODEL_SPEC)[:2]
# Findings, not test bugs: vLLM 0.32 answers non-finite prompt_embeds with HTTP 200 (an empty
# completion). Expected only as exactly that: HTTP 200, the server healthy, the valid answers
# unchanged; a 5xx, a dead server or changed answers stay red, and so does a 4xx (the day vLLM
# rejects them, the finding goes).
NON_FINITE = ("non-finite prompt_embeds: vLLM answers NaN and inf prompt_embeds with HTTP 200 and an empty "
              "completion (findings/prompt-embeds-nonfinite, 0.32.0 to 0.34.0)")
FINDINGS = {"embeds-nan": NON_FINITE, "embeds-inf": NON_FINITE}
CASES = [pytest.param(c, id=c.name)
         for c in bad_input.cases(SETTINGS["TESTBED_SERVED_MODEL"], max_model_len=int(SETTINGS["TESTBED_MAX_MODEL_LEN"]))]


@pytest.fixture(scope="session")
def before(cluster: LiveCluster) -> dict[str, Record]:
    """Answers to valid requests before any bad input: what every later answer must equal."""
    records = cluster.run("bad-input", _VALID)
    judge(cluster, timeouts.check(records))
    return bitexact.first_answers(records)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_a_4xx_and_costs_nothing(cluster: LiveCluster, before: dict[str, Record],
                                                case: bad_input.BadRequest) -> None:
    if cluster.dead:
        pytest.fail(f"not run: {cluster.dead}")
    if not cluster.backend.owned:
        pytest.skip("bad input could bring down a cluster the testbed only observes (external)")
    answer = bad_input.send(cluster.backend.base_url, case, timeout=REQUEST_TIMEOUT_S)
    REPORT.notes.append(f"{cluster.profile} bad input `{case.name}` ({case.what}): "
                        f"HTTP {answer.status} in {answer.seconds:.2f} s: {answer.message}")
    after = cluster.run("bad-input", _VALID)
    problems = bad_input.problems(answer, healthy=cluster.healthy())
    verdict = bitexact.check(after, before, name="valid answers after the bad input")
    if not verdict.ok:
        problems.append(str(verdict))
    finding = FINDINGS.get(case.name)
    if finding and bad_input.is_known_finding(answer, problems):
        pytest.xfail(finding)
    if finding and not problems:
        problems.append(f"{case.what}: HTTP {answer.status} now, not the known finding ({finding}): "
                        "drop it from FINDINGS")
    assert not problems, "\n".join(problems)
