"""``make upstream``: every finding's repro, stock and with its fix; report in reports/upstream-<time>/."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.upstream import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated finding names (default: all)")
    parser.add_argument("--bench", type=int, default=0, metavar="ROUNDS",
                        help="also measure each fix's cost: ROUNDS of repro.py --bench, stock and patched interleaved")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.bench and args.bench < run.MIN_BENCH_ROUNDS:
        parser.error(f"--bench needs at least {run.MIN_BENCH_ROUNDS} rounds (the spread of fewer is not measured)")
    try:
        findings = run.discover(only=[n for n in args.only.split(",") if n])
    except run.FindingError as exc:
        parser.error(str(exc))
    # SIGTERM (a CI job cancelled) unwinds like Ctrl-C; each repro's session is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out or REPO_ROOT / "reports" / f"upstream-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    verdicts = []
    data: dict = {}
    for finding in findings:
        verdict = run.run_one(finding, out, bench_rounds=args.bench)
        verdicts.append(verdict)
        data = run.write_report(verdicts, out)
        print(f"[{time.monotonic() - start:5.0f} s] {finding.name}: stock {verdict.stock_result}, "
              f"patched {verdict.patched_result}{' (' + verdict.problem + ')' if verdict.problem else ''}", flush=True)
    print()
    print(run.markdown(data))
    print(f"\nreport: {out / 'upstream.md'}")
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
