"""``make bisect``: the first release (or commit) where a test's outcome changes, with the overlay per step.

``GOOD`` is where the test passes, ``BAD`` where it fails; either may be the older one. Over
releases (``GOOD=0.26.0 BAD=0.32.0``) every final ``vllm`` release between them is a
candidate; over a local git checkout (``REPO=dir``, ``GOOD``/``BAD`` commits) the commits on
the first-parent line from the older to the newer, each exported with ``git archive`` (the
checkout itself is never touched). Each step runs the test against that vLLM's Python code
overlaid onto the installed compiled parts, with the modes set to ``upstream`` (the code under
judgement is vLLM's own, so a known failure is a failure here). A step whose test cannot run
(the overlay does not import, nothing collected) is skipped, as ``git bisect skip`` would.

Prints the first release/commit with the newer endpoint's outcome ("first bad" when the test
broke, "first good" when it was fixed) and that step's test output; writes
``reports/bisect-<time>/{bisect.json,bisect.md}`` and one log per step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_zerocopy_testbed.config import ARENA_ENV, BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV, REPO_ROOT
from vllm_zerocopy_testbed.vllm_source import Spec, VllmSourceError, prepare, releases

PASS, FAIL, SKIP = "pass", "fail", "skip"
STEP_TIMEOUT_S = 900


@dataclass
class Step:
    name: str  # release version or commit
    outcome: str  # pass | fail | skip
    seconds: float
    summary: str  # pytest's last line, or why it was skipped
    overlay: str = ""  # the overlay's hash
    log: str = ""


@dataclass
class Bisection:
    good: str
    bad: str
    test: list[str]
    candidates: list[str]  # oldest first
    steps: list[Step] = field(default_factory=list)
    first: str | None = None  # the first candidate with the newer endpoint's outcome
    ambiguous: list[str] = field(default_factory=list)  # skipped candidates it may be among
    term: str = ""  # "first bad" or "first good"


def pytest_args(test: str) -> list[str]:
    """``TEST``: test paths/ids (``tests/...``) as they are; anything else a ``-k`` expression over the
    unit and component tests."""
    words = test.split()
    if words and all(w.startswith("tests/") or w.startswith("-") for w in words):
        return words
    return ["tests/unit", "tests/component", "-k", test]


def run_test(spec: Spec, test: list[str], log: Path) -> Step:
    """Run ``test`` over ``spec``'s overlay; return the step (a test that cannot run is skipped)."""
    start = time.monotonic()
    try:
        overlay = prepare(spec)
    except VllmSourceError as exc:
        return Step(spec.value, SKIP, time.monotonic() - start, f"no overlay: {exc}")
    env = overlay.env()
    for name in (BROADCAST_ENV, DETACH_ENV, INFLIGHT_ENV, ARENA_ENV):
        env[name] = "upstream"
    env.pop("TESTBED_VLLM", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", *test]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = f"{exc.stdout or ''}\n... did not finish within {STEP_TIMEOUT_S} s", -1
    log.write_text(f"$ {' '.join(cmd)}\n# {overlay.describe()}\n{output}")
    lines = [l for l in output.strip().splitlines() if l.strip()]
    summary = lines[-1].strip("= ") if lines else f"exit {rc}"
    # 1 is a failure only where a test failed: errors alone (setup, collection: the code did not
    # import) say nothing of the property; 2-5 (interrupted, internal error, usage, none collected) neither.
    outcome = PASS if rc == 0 else FAIL if rc == 1 and " failed" in f" {summary}" else SKIP
    return Step(spec.value, outcome, round(time.monotonic() - start, 1), summary, overlay.hash, str(log))


def bisect(candidates: list[str], spec_of, test: list[str], out: Path, good: str, bad: str) -> Bisection:
    """Binary search over ``candidates`` (oldest first; the endpoints first and last)."""
    result = Bisection(good=good, bad=bad, test=test, candidates=candidates)
    known: dict[int, str] = {}

    def outcome(i: int) -> str:
        step = run_test(spec_of(candidates[i]), test, out / f"{i:03d}-{candidates[i][:12]}.log")
        step.name = candidates[i]  # a commit's tree is a scratch folder: the step is named by the commit
        result.steps.append(step)
        print(f"bisect: {candidates[i][:12]}: {step.outcome} ({step.summary}, {step.seconds:.0f} s)", flush=True)
        known[i] = step.outcome
        return step.outcome

    lo, hi = 0, len(candidates) - 1
    old, new = outcome(lo), outcome(hi)
    want_old = PASS if candidates[0] == good else FAIL
    if old != want_old or new == old or SKIP in (old, new):
        raise VllmSourceError(
            f"the endpoints do not differ as named: {candidates[lo]} {old}, {candidates[hi]} {new} "
            f"(GOOD={good} must pass and BAD={bad} fail): see {out}")
    result.term = "first bad" if old == PASS else "first good"
    skipped: set[int] = set()
    while True:
        between = [i for i in range(lo + 1, hi) if i not in skipped]
        if not between:
            break
        mid = between[len(between) // 2]
        got = outcome(mid)
        if got == SKIP:
            skipped.add(mid)
        elif got == old:
            lo = mid
        else:
            hi = mid
    result.first = candidates[hi]
    result.ambiguous = [candidates[i] for i in sorted(skipped) if lo < i < hi]
    return result


def release_candidates(good: str, bad: str) -> list[str]:
    try:
        older, newer = sorted((Version(good), Version(bad)))
    except InvalidVersion:
        raise VllmSourceError(f"GOOD={good} BAD={bad}: name two releases (or REPO= and two commits)") from None
    found = releases(str(older), str(newer))
    for end in (str(older), str(newer)):
        if end not in found:
            raise VllmSourceError(f"{end}: not a vllm release on the package index (releases: {', '.join(found)})")
    return found


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise VllmSourceError(f"git {' '.join(args)} in {repo}: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip()


def commit_candidates(repo: Path, good: str, bad: str) -> list[str]:
    """The first-parent commits from the older endpoint to the newer (both included), oldest first."""
    good_c, bad_c = _git(repo, "rev-parse", f"{good}^{{commit}}"), _git(repo, "rev-parse", f"{bad}^{{commit}}")
    ancestor = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good_c, bad_c]).returncode == 0
    older, newer = (good_c, bad_c) if ancestor else (bad_c, good_c)
    line = _git(repo, "rev-list", "--first-parent", "--reverse", f"{older}..{newer}").split()
    if not line or line[-1] != newer:
        raise VllmSourceError(f"{good} and {bad}: neither is a first-parent ancestor of the other")
    return [older, *line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bisect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--good", required=True, help="release or commit where TEST passes")
    parser.add_argument("--bad", required=True, help="release or commit where TEST fails")
    parser.add_argument("--test", required=True, help="test paths (tests/...) or a -k expression")
    parser.add_argument("--repo", default="", help="a local vLLM git checkout: bisect its commits")
    parser.add_argument("--out", default="", help="report folder (default reports/bisect-<time>)")
    args = parser.parse_args(argv)
    out = Path(args.out or REPO_ROOT / "reports" / f"bisect-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    test = pytest_args(args.test)
    try:
        with tempfile.TemporaryDirectory(prefix="testbed-bisect-") as scratch:
            if args.repo:
                repo = Path(args.repo).resolve()
                candidates = commit_candidates(repo, args.good, args.bad)
                good, bad = _git(repo, "rev-parse", args.good), _git(repo, "rev-parse", args.bad)
                subjects = {c: _git(repo, "log", "-1", "--format=%h %s", c) for c in candidates}

                def spec_of(commit: str) -> Spec:
                    tree = Path(scratch) / commit[:12]
                    if not tree.exists():
                        tree.mkdir()
                        archive = tree / "src.tar"
                        _git(repo, "archive", "--format=tar", "-o", str(archive), commit, "vllm")
                        with tarfile.open(archive) as tar:
                            tar.extractall(tree, filter="data")
                        archive.unlink()
                    return Spec("checkout", str(tree))
            else:
                candidates = release_candidates(args.good, args.bad)
                good, bad = str(Version(args.good)), str(Version(args.bad))
                subjects = {c: c for c in candidates}

                def spec_of(release: str) -> Spec:
                    return Spec("release", release)

            print(f"bisect: {len(candidates)} candidates from {candidates[0][:12]} to {candidates[-1][:12]}; "
                  f"test: pytest {' '.join(test)}", flush=True)
            result = bisect(candidates, spec_of, test, out, good, bad)
    except VllmSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (out / "bisect.json").write_text(json.dumps(asdict(result), indent=1))
    first = next(s for s in reversed(result.steps) if s.name == result.first)
    lines = [f"# make bisect: {result.term} is {subjects[result.first]}", "",
             f"GOOD={args.good} (passes), BAD={args.bad} (fails), test: `pytest {' '.join(test)}` "
             f"(modes upstream), {len(result.steps)} steps of {len(candidates)} candidates.", "",
             "| candidate | outcome | s | pytest |", "|---|---|---|---|"]
    lines += [f"| {subjects[s.name]} | {s.outcome} | {s.seconds:.0f} | {s.summary} |" for s in result.steps]
    if result.ambiguous:
        lines += ["", f"Skipped candidates it may be among: {', '.join(result.ambiguous)}"]
    (out / "bisect.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n--- test output at {subjects[result.first]} ({first.log}) ---")
    print("\n".join(Path(first.log).read_text().splitlines()[-40:]) if first.log else first.summary)
    print(f"\nreport: {out / 'bisect.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
