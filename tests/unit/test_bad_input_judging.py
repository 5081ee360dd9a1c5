"""Bad-input judging: a known finding matches only itself."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.workload.bad_input import BadAnswer, is_known_finding, problems

pytestmark = pytest.mark.unit

WHAT = "a NaN in the rows"


def _answer(status: int | None, message: str = "ok") -> BadAnswer:
    return BadAnswer("embeds-nan", WHAT, status, message, 0.1)


def test_a_4xx_with_a_message_and_a_healthy_server_is_no_problem() -> None:
    assert problems(_answer(400, "bad embeds"), healthy=True) == []
    assert problems(_answer(400, " "), healthy=True) == [f"{WHAT}: HTTP 400 without a message"]


def test_the_finding_is_http_200_and_nothing_else() -> None:
    answer = _answer(200, "")
    found = problems(answer, healthy=True)
    assert found == [f"{WHAT}: HTTP 200, want 4xx: "]
    assert is_known_finding(answer, found)


@pytest.mark.parametrize("status, healthy, extra", [
    (500, True, []),  # a 5xx: the old strict xfail took it as the finding
    (None, False, []),  # no answer, the server dead
    (200, False, []),  # accepted, but the server is unhealthy after it
    (200, True, ["valid answers after the bad input: 1 problem(s)"]),  # accepted, later answers changed
    (400, True, []),  # rejected: vLLM fixed it, the finding must go (the test reports that)
])
def test_anything_else_is_not_the_finding(status, healthy, extra) -> None:
    answer = _answer(status, "Internal Server Error" if status == 500 else "")
    found = problems(answer, healthy=healthy) + extra
    assert not is_known_finding(answer, found)
