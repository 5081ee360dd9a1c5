"""Warm the server up before it counts as healthy: the first request compiles helper ops.

The head container runs this beside the API server; its healthcheck needs the
marker file, so ``make up`` returns a cluster whose next answer takes about a
second instead of 40-60 s (torch.compile helper ops built on one core).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def warm_up(url: str, model: str, timeout: float) -> float:
    """Wait for ``/health``, send one logprobs completion; return its seconds."""
    deadline = time.monotonic() + timeout
    while not _ready(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health not answering after {timeout:.0f} s")
        time.sleep(2)
    body = json.dumps({"model": model, "prompt": "Hello world", "max_tokens": 4, "temperature": 0,
                       "logprobs": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=max(1.0, deadline - start)) as response:
        json.load(response)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--marker", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        seconds = warm_up(args.url, args.model, args.timeout)
    except Exception as exc:  # the server's own log says why; keep the marker absent
        sys.exit(f"testbed warm-up failed: {exc}")
    args.marker.write_text(f"{seconds:.1f}\n")
    print(f"testbed warm-up: first completion answered in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
