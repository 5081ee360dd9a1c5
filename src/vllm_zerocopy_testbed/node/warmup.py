"""Warm the server up before it counts as healthy: the first request compiles helper ops.

The head container runs this beside the API server; its healthcheck needs the
marker file, so ``make up`` returns a cluster whose next answer takes about a
second instead of 40-60 s (torch.compile helper ops built on one core).
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_zerocopy_testbed.waits import wait_until


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
    first logprobs request deadlocks (issue 5), and the suites, not the start-up,
    must be the ones to show that.
    """
    deadline = time.monotonic() + timeout
    wait_until(f"{url}/health", lambda: is_healthy(url), timeout=timeout, poll_s=0.5)
    start = time.monotonic()
    plain = {"model": model, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    complete(url, plain, deadline)
    from vllm_zerocopy_testbed.workload.embeds import encode, rows_for, token_ids

    rows = encode(rows_for(token_ids(8), directory=model_dir))
    complete(url, {**plain, "prompt": None, "prompt_embeds": rows}, deadline)
    if logprobs:
        complete(url, {**plain, "logprobs": 1}, deadline)
    return time.monotonic() - start


# torch inductor builds a precompiled header (~150 MB, g++ on one core: most of a cold warm-up)
# for the C++ it compiles on the first requests, always in its default folder whatever
# TORCHINDUCTOR_CACHE_DIR says (codecache._HEADER_DIR); compose keeps that folder on a volume.
HEADERS = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}" / "precompiled_headers"
CACHE_LINE = re.compile(r"compile cache: (?P<before>\d+) precompiled headers? at start, (?P<built>\d+) built now")


def headers(folder: Path = HEADERS) -> dict[str, int]:
    """The precompiled headers in ``folder``: name -> modification time (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.gch")} if folder.is_dir() else {}


def cache_report(before: dict[str, int], after: dict[str, int]) -> str:
    """The warm-up's line on the compile cache: what was there, what had to be built (``CACHE_LINE``)."""
    built = [name for name, mtime in after.items() if before.get(name) != mtime]
    return f"compile cache: {len(before)} precompiled headers at start, {len(built)} built now"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("--logprobs", action="store_true", help="also compile the logprobs path")
    parser.add_argument("--model-dir", type=Path, required=True, help="the served model (embedding rows)")
    args = parser.parse_args(argv)
    before = headers()  # before the server starts: the ranks of this node compile on their first requests
    try:
        seconds = warm_up(args.url, args.model, args.timeout, logprobs=args.logprobs, model_dir=args.model_dir)
    except Exception as exc:  # the server's own log says why; keep the marker absent
        sys.exit(f"testbed warm-up failed: {exc}")
    args.marker.write_text(f"{seconds:.1f}\n")
    print(f"testbed warm-up: first completions answered in {seconds:.1f} s; {cache_report(before, headers())}",
          flush=True)


if __name__ == "__main__":
    main()


def warms_logprobs(executor: str, inflight: str) -> bool:
    """Whether start-up may warm the logprobs path: V2, or the compiled graph with the issue-5 fix."""
    return executor == "v2" or inflight == "testbed"
