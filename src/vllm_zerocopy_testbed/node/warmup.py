"""Warm the server up before it counts as healthy: the first request compiles helper ops.

The head container runs this beside the API server; its healthcheck needs the
marker file, so ``make up`` returns a cluster whose next answer takes about a
second instead of 40-60 s (torch.compile helper ops built on one core).
"""

from __future__ import annotations

import argparse
import getpass
import re
import sys
import tempfile
from pathlib import Path

from vllm_zerocopy_testbed.workload.warmup import warm_up


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


def warms_logprobs(executor: str, inflight: str) -> bool:
    """Whether start-up may warm the logprobs path: V2, or the compiled graph with the in-flight cap
    (patches/inflight.py, findings/cgraph-raylet-writeacquire)."""
    return executor == "v2" or inflight == "testbed"


if __name__ == "__main__":
    main()
