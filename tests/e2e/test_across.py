"""Across profiles: the transport and the executor must not change one bit of any answer.

Runs last (see conftest), over every profile's recorded history: for each pair
of profiles, every request both answered must have identical tokens and
logprobs. Each profile ran on a cluster of its own, so this also compares
answers across restarts.
"""

from __future__ import annotations

import pytest

from live.suite import HISTORY, PROFILES, bitexact

pytestmark = [pytest.mark.e2e, pytest.mark.suite("across"), pytest.mark.timeout(60)]

# Suites whose requests every profile sends the same way (the batch order of concurrent ones may differ).
_COMPARED = ("embeds", "logprobs", "sequential", "restart")


def test_every_profile_gives_the_same_answers() -> None:
    answered = {str(p): bitexact.first_answers(r for s in _COMPARED for r in HISTORY.records(profile=str(p), suite=s))
                for p in PROFILES}
    answered = {p: a for p, a in answered.items() if a}
    if len(answered) < 2:
        pytest.skip(f"fewer than two profiles answered anything: {sorted(answered)}")
    verdict = bitexact.across(answered)
    assert verdict.ok, f"{verdict}\ncompared: {verdict.figures}"
