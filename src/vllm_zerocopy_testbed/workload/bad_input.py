"""Malformed requests: each must get a 4xx with a message, and cost the server nothing.

Every case is sent raw (``requests``, not the typed client) so that the testbed,
not a client library, decides what goes on the wire.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import requests
import torch

from vllm_zerocopy_testbed.workload.embeds import HIDDEN, encode, rows_for, token_ids


@dataclass(frozen=True)
class BadRequest:
    """One malformed completion request and what is wrong with it."""

    name: str
    what: str
    body: dict[str, Any]


@dataclass
class BadAnswer:
    """What the server answered to a bad request."""

    name: str
    what: str
    status: int | None
    message: str
    seconds: float


def cases(model: str, max_model_len: int, max_logprobs: int = 20) -> list[BadRequest]:
    """Return the malformed requests the fault suite sends."""
    base = {"model": model, "max_tokens": 4, "temperature": 0}
    good = rows_for(token_ids(8))
    nan_rows, inf_rows = good.clone(), good.clone()
    nan_rows[2, 5] = math.nan
    inf_rows[3, 7] = math.inf
    embeds = lambda value: {**base, "prompt": None, "prompt_embeds": value}  # noqa: E731
    return [
        BadRequest("embeds-not-base64", "prompt_embeds is not base64", embeds("@@not base64@@")),
        BadRequest("embeds-not-torch", "base64 of bytes that are not a torch.save file",
                   embeds(base64.b64encode(b"hello world").decode())),
        BadRequest("embeds-rank-1", "a 1-D tensor", embeds(encode(good[0].clone()))),
        BadRequest("embeds-rank-4", "a 4-D tensor", embeds(encode(good.reshape(1, 1, 8, HIDDEN).clone()))),
        BadRequest("embeds-hidden", f"hidden size 64, the model's is {HIDDEN}", embeds(encode(good[:, :64].clone()))),
        BadRequest("embeds-nan", "a NaN in the rows", embeds(encode(nan_rows))),
        BadRequest("embeds-inf", "an inf in the rows", embeds(encode(inf_rows))),
        BadRequest("embeds-empty", "zero rows", embeds(encode(torch.zeros(0, HIDDEN)))),
        BadRequest("embeds-too-long", f"{max_model_len + 1} rows, past --max-model-len",
                   embeds(encode(rows_for(token_ids(max_model_len + 1))))),
        BadRequest("embeds-int", "an integer tensor", embeds(encode(torch.ones(8, HIDDEN, dtype=torch.int64)))),
        BadRequest("logprobs-too-many", f"logprobs={max_logprobs + 1}, past --max-logprobs",
                   {**base, "prompt": list(token_ids(8)), "logprobs": max_logprobs + 1}),
        BadRequest("embeds-with-prompt-logprobs", "prompt_embeds together with prompt_logprobs",
                   {**embeds(encode(good)), "prompt_logprobs": 1}),
        BadRequest("regex-invalid", "a structured-output regex that does not parse (unclosed group)",
                   {**base, "prompt": list(token_ids(8)), "structured_outputs": {"regex": "([0-9]{3"}}),
    ]


def send(base_url: str, case: BadRequest, timeout: float) -> BadAnswer:
    """POST ``case`` to ``{base_url}/completions``; return the status and the error message."""
    import time

    start = time.monotonic()
    try:
        response = requests.post(f"{base_url}/completions", json=case.body, timeout=timeout)
    except requests.RequestException as exc:
        return BadAnswer(case.name, case.what, None, f"no HTTP answer: {exc}"[:300], time.monotonic() - start)
    try:
        payload = response.json()
        message = payload.get("error", {}).get("message") or payload.get("message") or str(payload)[:200]
    except ValueError:
        message = response.text[:200]
    return BadAnswer(case.name, case.what, response.status_code, str(message)[:300], time.monotonic() - start)


def problems(answer: BadAnswer, *, healthy: bool) -> list[str]:
    """What is wrong with how the server took a bad request: not a 4xx with a message, or unhealthy after."""
    found = []
    if answer.status is None or not 400 <= answer.status < 500:
        found.append(f"{answer.what}: HTTP {answer.status}, want 4xx: {answer.message}")
    elif not answer.message.strip():
        found.append(f"{answer.what}: HTTP {answer.status} without a message")
    if not healthy:
        found.append(f"{answer.what}: /health fails after it")
    return found


def is_known_finding(answer: BadAnswer, found: list[str]) -> bool:
    """Whether a case's failure is exactly the known finding "vLLM accepts it with HTTP 200": that
    status and no other problem (the server healthy, later answers unchanged). A 5xx, a dead
    server, changed answers or a 4xx are not it."""
    return answer.status == 200 and found == problems(answer, healthy=True)
