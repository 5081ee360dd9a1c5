"""Bit-exactness: the same request gives the same tokens and logprobs.

``tolerance=0`` compares floats exactly (transport and repeats must not change one
bit); a tolerance is for a different parallel layout, where TP's all-reduce sums
fp32 partials in another order (TP=2 and TP=1 differ in the last digits, under 1e-5).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.workload.requests import Record


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is b
    if tolerance == 0:
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= tolerance


def _prompt_values(entries: list[Any] | None) -> list[dict[str, float]]:
    """prompt_logprobs entries as {token: logprob} (the API nests each in a dict with rank/decoded)."""
    out = []
    for entry in entries or []:
        if entry is None:
            out.append({})
        else:
            out.append({k: (v["logprob"] if isinstance(v, dict) else v) for k, v in entry.items()})
    return out


def differences(a: Record, b: Record, tolerance: float = 0.0, *, tokens_only: bool = False) -> list[str]:
    """Return how answer ``b`` differs from answer ``a`` (empty when equal)."""
    if len(a.choices) != len(b.choices):
        return [f"{len(a.choices)} vs {len(b.choices)} choices"]
    found: list[str] = []
    for i, (x, y) in enumerate(zip(a.choices, b.choices)):
        if "tokens" not in x and x.get("text") != y.get("text"):  # asked without logprobs: no token ids
            found.append(f"choice {i}: text {x.get('text')!r} vs {y.get('text')!r}")
            continue
        if x.get("tokens") != y.get("tokens"):
            found.append(f"choice {i}: tokens {x.get('tokens')} vs {y.get('tokens')}")
            continue
        if tokens_only:
            continue
        for pos, (p, q) in enumerate(zip(x.get("token_logprobs", []), y.get("token_logprobs", []))):
            if not _close(p, q, tolerance):
                found.append(f"choice {i} token {pos}: logprob {p!r} vs {q!r}")
        for pos, (p, q) in enumerate(zip(x.get("top_logprobs", []), y.get("top_logprobs", []))):
            if set(p) != set(q) or not all(_close(p[k], q[k], tolerance) for k in p):
                found.append(f"choice {i} token {pos}: top logprobs {p} vs {q}")
        px, py = _prompt_values(x.get("prompt_logprobs")), _prompt_values(y.get("prompt_logprobs"))
        if len(px) != len(py):
            found.append(f"choice {i}: {len(px)} vs {len(py)} prompt logprob positions")
        for pos, (p, q) in enumerate(zip(px, py)):
            if set(p) != set(q) or not all(_close(p[k], q[k], tolerance) for k in p):
                found.append(f"choice {i} prompt position {pos}: {p} vs {q}")
    return found


def largest_gap(records: Iterable[Record], expected: dict[str, Record]) -> float:
    """The largest |difference| of a sampled or top logprob between each record and its expected
    answer, over tokens both gave (what a tolerance must cover; 0.0 when all are equal)."""
    gap = 0.0
    for record in records:
        if record.key not in expected:
            continue
        for x, y in zip(expected[record.key].choices, record.choices):
            for p, q in zip(x.get("token_logprobs") or [], y.get("token_logprobs") or []):
                if p is not None and q is not None:
                    gap = max(gap, abs(p - q))
            for p, q in zip(x.get("top_logprobs") or [], y.get("top_logprobs") or []):
                gap = max([gap, *(abs(p[k] - q[k]) for k in p.keys() & q.keys())])
    return gap


def check(records: Iterable[Record], expected: dict[str, Record], *, tolerance: float = 0.0,
          tokens_only: bool = False, name: str = "bit-exact") -> Verdict:
    """Compare every answered record with ``expected[record.key]``; fail on any difference."""
    verdict = Verdict(name)
    compared = 0
    for record in records:
        if not record.ok:
            continue  # the timeouts checker reports it
        if record.key not in expected:
            verdict.fail(f"{record.key}: nothing to compare with")
            continue
        compared += 1
        for difference in differences(expected[record.key], record, tolerance, tokens_only=tokens_only)[:3]:
            verdict.fail(f"{record.key}: {difference}")
    if compared == 0:
        verdict.fail("no answered request to compare")
    verdict.figures["compared"] = compared
    return verdict


def first_answers(records: Iterable[Record]) -> dict[str, Record]:
    """Return the first answered record of each key (what repeats must equal)."""
    firsts: dict[str, Record] = {}
    for record in records:
        if record.ok:
            firsts.setdefault(record.key, record)
    return firsts


def across(answered: dict[str, dict[str, Record]]) -> Verdict:
    """Every request two profiles both answered must be bit-exact between them; comparing nothing fails.

    ``answered``: profile -> (key -> first answer). A pair of profiles with no request in
    common compares nothing; if no pair compares anything, the check cannot speak and fails.
    """
    verdict = Verdict("profiles agree")
    for (name_a, a), (name_b, b) in itertools.combinations(answered.items(), 2):
        common = sorted(set(a) & set(b))
        for key in common:
            for difference in differences(a[key], b[key])[:2]:
                verdict.fail(f"{name_a} vs {name_b}, {key}: {difference}")
        verdict.figures[f"{name_a} vs {name_b}"] = len(common)
    if not sum(verdict.figures.values()):
        verdict.fail(f"no request was answered by two profiles: nothing compared ({sorted(answered)})")
    return verdict
