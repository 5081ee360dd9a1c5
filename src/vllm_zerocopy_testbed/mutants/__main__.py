"""``make mutants``: every mutant of ``catalog.py`` against its tests; ``--full``: the mechanical set
(``mechanical.py``); report in reports/mutants-<time>/ (``--full``: reports/mutants-full-<time>/)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.mutants import catalog, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--full", action="store_true",
                        help="the mechanical set: cosmic-ray's operators over every function, judged by coverage")
    parser.add_argument("--limit", type=int, default=0, help="--full: judge at most this many pending mutants")
    parser.add_argument("--only-function", default="", help="--full: one function (qualified name or its tail)")
    parser.add_argument("--only-module", default="", help="--full: one module (e.g. shm_broadcast)")
    parser.add_argument("--coverage-tests", default="",
                        help="--full: the tests the coverage map comes from (paths, space-separated; default: "
                        "unit and component tests)")
    parser.add_argument("--coverage-select", default="", help="--full: pytest -k for the coverage run")
    parser.add_argument("--report", action="store_true",
                        help="--full: write the report of what the session judged so far, run nothing")
    args = parser.parse_args(argv)
    if args.full:
        return _full(args)
    try:
        mutants = catalog.by_name([n for n in args.only.split(",") if n])
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        for m in mutants:
            print(f"{m.name:42} {m.module.rsplit('.', 1)[-1]:16} -k '{m.select}' {' '.join(m.tests)}")
        return 0
    # SIGTERM (a CI job cancelled) unwinds like Ctrl-C, so the running pytest group is killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out or REPO_ROOT / "reports" / f"mutants-{time.strftime('%Y%m%d-%H%M%S')}"
    start = time.monotonic()
    fates = run.run(mutants, out, say=lambda text: print(f"[{time.monotonic() - start:6.0f} s] {text}", flush=True))
    counts = run.summary(fates)
    print(f"report: {out / 'mutants.md'}: {counts}")
    # Red when a mutant survives without an argument, or could not be judged.
    return 1 if counts[run.SURVIVED] or counts[run.ERROR] else 0


def _full(args: argparse.Namespace) -> int:
    """The mechanical set: resumable; red while a mutant survives unargued or cannot be judged."""
    import logging

    from vllm_zerocopy_testbed.mutants import coverage_map, mechanical

    logging.basicConfig(level=logging.WARNING)
    request = mechanical.FULL_COVERAGE
    if args.coverage_tests or args.coverage_select:
        request = coverage_map.CoverageRequest(tuple(args.coverage_tests.split()) or request.paths,
                                               "" if args.coverage_tests else request.marker, args.coverage_select)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out or REPO_ROOT / "reports" / f"mutants-full-{time.strftime('%Y%m%d-%H%M%S')}"
    start = time.monotonic()
    selection = mechanical.Selection(args.only_module, args.only_function, args.limit)
    counts = mechanical.run_full(selection, out, request, list_only=args.list, report_only=args.report,
                                 say=lambda text: print(f"[{time.monotonic() - start:6.0f} s] {text}", flush=True))
    if args.list:
        return 0
    print(f"report: {out / 'mechanical.md'}: {dict(counts)}")
    return 1 if any(counts.get(fate) for fate in (mechanical.SURVIVED, mechanical.UNCOVERED, mechanical.ERROR)) else 0


if __name__ == "__main__":
    sys.exit(main())
