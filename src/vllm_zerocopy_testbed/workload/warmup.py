"""The requests that warm a vLLM server up, and its health probe: what a client sends first.

Used by the head container's warm-up (``node/warmup.py``), by the host-side backends that start a
server themselves, and by anything that waits for ``/health``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_zerocopy_testbed.waits import wait_until
from vllm_zerocopy_testbed.workload.embeds import encode, rows_for, token_ids


def is_healthy(url: str) -> bool:
    """Return whether the server at ``url`` (no ``/v1``) answers ``/health`` with 200 within 3 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def complete(url: str, body: dict, deadline: float) -> None:
    """POST ``body`` to ``url``/v1/completions by ``deadline``; raise unless it answers 200 with JSON."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as response:
        json.load(response)


def warm_up(url: str, model: str, timeout: float, *, logprobs: bool = False, model_dir: Path | None = None) -> float:
    """Wait for ``/health``, then compile what the suites use; return the seconds the requests took.

    A plain completion, a prompt_embeds one (its own compiled shapes; rows of the
    model in ``model_dir``, default the testbed's own build), and with
    ``logprobs`` one asking for logprobs (the sampler's rank op compiles on first
    use). Not on the compiled-graph executor without the testbed's fix: there the
    first logprobs request deadlocks (findings/cgraph-raylet-writeacquire), and the
    suites, not the start-up, must be the ones to show that.
    """
    deadline = time.monotonic() + timeout
    wait_until(f"{url}/health", lambda: is_healthy(url), timeout=timeout, poll_s=0.5)
    start = time.monotonic()
    plain = {"model": model, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    complete(url, plain, deadline)
    rows = encode(rows_for(token_ids(8), directory=model_dir))
    complete(url, {**plain, "prompt": None, "prompt_embeds": rows}, deadline)
    if logprobs:
        complete(url, {**plain, "logprobs": 1}, deadline)
    return time.monotonic() - start
