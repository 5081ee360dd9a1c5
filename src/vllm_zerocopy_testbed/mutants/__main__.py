"""``make mutants``: every mutant of ``catalog.py`` against its tests; report in reports/mutants-<time>/."""

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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
