"""``make check VLLM=<checkout | wheel | release> [BASE=<release | checkout>] [FULL=1]``: your vLLM change
against its base, one table: per property and path FIXED / BROKE / STILL-FAILING / SAME, what it cost
(speed, interleaved, with the machine's noise) and memory; report in ``reports/check-<run>/``.

Exit 0: nothing broke. 1: a BROKE row, a speed regression, a hang, or an error of the testbed. 2: the
input cannot be checked (one line says why).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Callable

from vllm_zerocopy_testbed.check import cache, compare, e2e, report, resolve, side, speed, suites
from vllm_zerocopy_testbed.config import REPO_ROOT

PARTS = ("suites", "speed", "e2e")
SIDE_BOUND_S = 900.0  # a side's suites took 6.5 min on 2 cores beside other runs


def _side_info(s: resolve.Side) -> dict:
    return {"spec": s.spec, "kind": s.kind, "version": s.version, "code": s.code_id, "make_arg": s.make_arg,
            "describe": s.describe(), "notes": s.notes, "lacks": s.lacks,
            "overlay": asdict(s.overlay) if s.overlay is not None else None}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def plan(candidate: resolve.Side, base: resolve.Side, parts: list[str]) -> tuple[list[str], list[str]]:
    """What the run says before it starts, and the parts it runs: C++/CUDA an overlay cannot carry (the
    Python paths are judged all the same), and no e2e where a side cannot serve here."""
    notes = [f"{s.label}: {s.overlay.compiled_note}; its Python paths are judged below"
             for s in (candidate, base) if s.overlay is not None and s.overlay.compiled_note]
    parts = list(parts)
    if "e2e" in parts:
        blocked = [f"{s.label} {s.version}: {s.e2e_blocker}" for s in (candidate, base) if s.e2e_blocker]
        if blocked:
            notes.append("component rows only, no e2e: " + "; ".join(blocked))
            parts.remove("e2e")
    else:
        notes.append("no e2e tier in this run (CHECK_E2E=0 or PARTS without e2e): component rows only")
    return notes, parts


def _saved_base(s: resolve.Side, step: str, selection: list[str], fresh: bool, result: report.CheckResult,
                say: Callable[[str], None]) -> side.SideRun | None:
    """The base's outcomes of ``step`` from an earlier check under the same testbed, or None (run it)."""
    if s.label != "base" or fresh:
        return None
    ran = cache.load(cache.key(s, step, selection))
    if ran is not None:
        note = (f"base {step}: the outcomes of an earlier check of the same base under the same testbed "
                f"({ran.log}); FRESH_BASE=1 runs them again")
        result.notes.append(note)
        say(f"note: {note}")
    return ran


def _keep_base(s: resolve.Side, step: str, selection: list[str], ran: side.SideRun) -> None:
    if s.label == "base":
        cache.save(cache.key(s, step, selection), ran)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="", help="the candidate: a checkout folder, a wheel file or a release")
    parser.add_argument("--base", default="", help="the base: a release or a checkout (default: the one the "
                        "candidate derives from)")
    parser.add_argument("--full", action="store_true", help="every e2e suite instead of the smoke")
    parser.add_argument("--no-e2e", action="store_true", help="no e2e tier (component suites and speed only)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--run", default="", help="report folder name under reports/ (default check-<time>-<pid>)")
    parser.add_argument("--side-bound", type=float, default=SIDE_BOUND_S, help="seconds one side's suites may take")
    parser.add_argument("--fresh-base", action="store_true", help="run the base's suites and e2e again instead of "
                        "taking them from the last check of the same base under the same testbed")
    args = parser.parse_args(argv)
    # timeout(1) or a CI job's cancel: end like Ctrl-C, so that every side's processes are ended
    signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=logging.WARNING, format="make check: %(message)s")
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; use {', '.join(PARTS)}")
    if args.no_e2e and "e2e" in parts:
        parts.remove("e2e")
    run = args.run or f"check-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    out = REPO_ROOT / "reports" / run
    start = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {text}", flush=True)

    say(f"resolving VLLM={args.vllm or '(none)'}" + (f", BASE={args.base}" if args.base else ", default base"))
    try:
        candidate, base = resolve.resolve(args.vllm, args.base)
    except resolve.CheckInputError as exc:
        print(f"make check: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    command = "make check " + " ".join(
        [f"VLLM={shlex.quote(args.vllm)}"] + ([f"BASE={shlex.quote(args.base)}"] if args.base else [])
        + (["FULL=1"] if args.full else []))
    result = report.CheckResult(run, _side_info(candidate), _side_info(base), base.why, command)
    result.steps["resolve"] = round(time.monotonic() - start, 1)
    say(f"candidate: {candidate.describe()}")
    say(f"base:      {base.describe()} (taken because: {base.why})")
    result.notes, parts = plan(candidate, base, parts)
    for note in result.notes:
        say(f"note: {note}")
    try:
        result.changed = resolve.changed_files(base, candidate)
    except OSError as exc:
        result.notes.append(f"could not list the changed files: {exc}")
    say(f"{len(result.changed)} vllm/ Python files differ from the base"
        + (f": {', '.join(result.changed[:5])}{', ...' if len(result.changed) > 5 else ''}" if result.changed else ""))

    try:
        if "suites" in parts:
            tests = list(suites.COMPONENT_TESTS) + (list(suites.FULL_TESTS) if args.full else [])
            for s in (base, candidate):
                t0 = time.monotonic()
                ran = _saved_base(s, "suites", tests, args.fresh_base, result, say)
                if ran is None:
                    say(f"{s.label}: component suites ({len(tests)} selections), every mode upstream, "
                        f"bound {args.side_bound:.0f} s")
                    ran = side.run_side(s, tests, out, args.side_bound, say)
                    _keep_base(s, "suites", tests, ran)
                result.sides[s.label] = ran
                result.steps[f"{s.label} suites"] = round(time.monotonic() - t0, 1)
                counts = {o: sum(1 for t in ran.outcomes if t.outcome == o) for o in
                          (compare.PASSED, compare.FAILED, compare.HANG, compare.SKIPPED)}
                say(f"{s.label}: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n)
                    + f" in {ran.seconds:.0f} s" + (f"; {ran.bound_passed}" if ran.bound_passed else "")
                    + (f"; ERROR {ran.error}" if ran.error else ""))
                if ran.bound_passed:
                    result.errors.append(f"hang: the {s.label}'s suites {ran.bound_passed} (log {ran.log})")
                if ran.error:
                    result.errors.append(f"{s.label}'s suites: {ran.error}")
            result.rows = compare.rows(result.sides["base"].outcomes, result.sides["candidate"].outcomes)
        if "speed" in parts:
            say("speed: broadcast (local, remote) and arena, base and candidate taking turns, the idle side stopped")
            t0 = time.monotonic()
            result.speed = speed.run(base, candidate, out, say)
            speed.charge_fixes(result.speed.cells, {r.path for r in result.rows if r.verdict == compare.FIXED},
                               frozenset(r.path for r in result.rows if r.verdict == compare.BROKE))
            result.steps["speed"] = round(time.monotonic() - t0, 1)
            if result.speed.error:
                result.errors.append(f"speed: {result.speed.error}")
        if "e2e" in parts:
            e2e_runs = {}
            step = f"e2e-{e2e.step(args.full).target}"
            stop_engine = e2e.ensure_engine(say)
            try:
                for s in (base, candidate):
                    t0 = time.monotonic()
                    ran = _saved_base(s, step, [], args.fresh_base, result, say)
                    if ran is None:
                        say(f"{s.label}: e2e ({e2e.step(args.full).target}, compose cluster, V2, modes upstream)")
                        ran = e2e.run_side(s, run, out, args.full, say)
                        _keep_base(s, step, [], ran)
                    e2e_runs[s.label] = ran
                    result.sides[f"e2e-{s.label}"] = ran
                    result.steps[f"{s.label} e2e"] = round(time.monotonic() - t0, 1)
                    if ran.bound_passed:
                        result.errors.append(f"hang: the {s.label}'s e2e {ran.bound_passed} (log {ran.log})")
                    if ran.error:
                        result.errors.append(f"{s.label}'s e2e: {ran.error}")
            finally:
                stop_engine()
            result.rows += compare.rows(e2e_runs["base"].outcomes, e2e_runs["candidate"].outcomes)
    except KeyboardInterrupt:
        result.errors.append("interrupted (Ctrl-C or SIGTERM): the table covers what finished")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the testbed's own error: red, said
        result.errors.append(str(exc))
    result.seconds = round(time.monotonic() - start, 1)
    written = report.write(result, out)
    print()
    print(report.terminal(result))
    print(f"\nwritten: {', '.join(str(p.relative_to(REPO_ROOT)) for p in written)}")
    return 1 if result.red else 0


if __name__ == "__main__":
    sys.exit(main())
