"""Which tests ran each function of the code under test, in every process they started; and which
function a mutation changed.

The map comes from one coverage.py run of the chosen tests: a context per test (the test's node
id), also in the processes a test starts (harness readers forked from a fork server, Ray workers),
where coverage.py's own subprocess patches would carry the first test's label: a
``sitecustomize.py`` in a scratch folder starts coverage in every Python process with the label of
the test running at that moment (an environment variable for spawned processes, a file read after
``fork`` for forked ones). It is stored as JSON under ``.cache/`` keyed by the digests of the
measured sources, the tests and the testbed's code, and reused while none of them changes; when only
test files changed, a map is built from the closest cached one by measuring those files alone.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from vllm_zerocopy_testbed.config import REPO_ROOT, process_env

log = logging.getLogger(__name__)

MODULE_LEVEL = "<module>"
# Outcomes of a test in the coverage run that make it a judge: it was green there, so a red
# run with a mutant in place is the mutant's doing. A strict xfail that passes is red too.
GREEN = frozenset({"passed", "xfailed"})
CONTEXT_ENV = "TESTBED_COV_CONTEXT"
CURRENT_TEST_ENV = "TESTBED_COV_TEST_FILE"
OUTCOMES_ENV = "TESTBED_COV_OUTCOMES"
COVERAGE_RUN_TIMEOUT_S = 3 * 3600
# Part of a map's key: a map of an older shape (no per-line tests) is built again, not reused.
MAP_FORMAT = "per-line tests"

# Runs at start-up of every Python process of the coverage run (stdlib and coverage only).
_SITECUSTOMIZE = '''\
"""Written by vllm_zerocopy_testbed.mutants.coverage_map: measure this process, labelled with the running test."""
import os

_RC = os.environ.get("COVERAGE_PROCESS_START")
if _RC:
    import coverage

    _real_exit = os._exit
    _state = {}

    def _start():
        cov = coverage.Coverage(config_file=_RC, data_suffix=True, auto_data=True,
                                context=os.environ.get("%(context)s", ""))
        cov._warn_no_data = False
        cov._warn_unimported_source = False
        cov._warn_preimported_source = False
        cov.start()
        _state["cov"] = cov

    def _exit(status):
        # multiprocessing's children end in os._exit: no atexit, so save here.
        try:
            _state["cov"].stop()
            _state["cov"].save()
        except Exception:
            pass
        _real_exit(status)

    def _after_fork():
        # A fork server's child runs the test of now, not the one its server started in. The
        # inherited measurement is left paused under the new one (not stopped: that would write
        # the server's lines again, from this process), and never saved here.
        _state["cov"]._auto_save = False
        try:
            with open(os.environ["%(current)s"]) as f:
                os.environ["%(context)s"] = f.read().strip()
        except (KeyError, OSError):
            pass
        _start()

    _start()
    os._exit = _exit
    os.register_at_fork(after_in_child=_after_fork)
'''


@dataclass(frozen=True)
class Function:
    """A function's qualified name and the lines of its body (nested functions' bodies excluded)."""

    qualname: str
    start: int  # first body line
    end: int  # last line
    nested: tuple[tuple[int, int], ...] = ()

    def owns(self, line: int) -> bool:
        return self.start <= line <= self.end and not any(a <= line <= b for a, b in self.nested)


def functions(source: str) -> list[Function]:
    """Return every function and method of ``source``, nested ones too (``outer.inner``)."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                nested = tuple((d.lineno, d.end_lineno or d.lineno) for d in ast.walk(child)
                               if d is not child and isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)))
                found.append(Function(name, child.body[0].lineno, child.end_lineno or child.lineno, nested))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def function_at(source: str | list[Function], line: int) -> str:
    """Return the qualified name of the function whose body holds ``line``, or ``<module>``.

    A ``def`` line, its decorators and default values run when the module or the enclosing
    function runs, so they belong there, not to the function.
    """
    funcs = functions(source) if isinstance(source, str) else source
    owners = [f for f in funcs if f.owns(line)]
    return owners[-1].qualname if owners else MODULE_LEVEL


def changed_lines(pristine: str, mutated: str) -> list[int]:
    """Return the 1-based lines of ``pristine`` that ``mutated`` replaced or deleted (or inserted after)."""
    matcher = difflib.SequenceMatcher(a=pristine.splitlines(), b=mutated.splitlines(), autojunk=False)
    lines: list[int] = []
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag in ("replace", "delete"):
            lines.extend(range(i1 + 1, i2 + 1))
        elif tag == "insert":
            lines.append(max(i1, 1))
    return lines


def traced_lines(source: str, line: int) -> tuple[int, ...]:
    """The lines under which coverage.py may have recorded ``line`` running: the line itself, then every
    line of the head of its innermost statement (a simple statement whole; an ``if``/``while``/``with``/...
    up to its body). A condition spread over several lines is traced line by line, and its ``if (``
    line, without code of its own, never: a change there ran if any line of the head ran."""
    head = next((span for span in _statement_heads(source) if span[0] <= line <= span[1]), None)
    return tuple(dict.fromkeys((line, *(range(head[0], head[1] + 1) if head else ()))))


@functools.lru_cache(maxsize=16)
def _statement_heads(source: str) -> tuple[tuple[int, int], ...]:
    """Every statement's head (first line, last line before its body), innermost first."""
    heads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = body[0].lineno - 1 if isinstance(body, list) and body else (node.end_lineno or node.lineno)
            heads.append((node.lineno, max(node.lineno, last)))
    return tuple(sorted(heads, key=lambda span: span[1] - span[0]))


def changed_function(pristine: str, mutated: str) -> str:
    """Return the function a mutation changed (diff -> first changed line -> enclosing function).

    Raises ``ValueError`` when the texts are the same, or the change spans two functions.
    """
    lines = changed_lines(pristine, mutated)
    if not lines:
        raise ValueError("the mutated source is the pristine one")
    funcs = functions(pristine)
    owners = {function_at(funcs, line) for line in lines}
    if len(owners) != 1:
        raise ValueError(f"the mutation changes several functions: {sorted(owners)}")
    return owners.pop()


@dataclass
class TestRecord:
    """One test of the coverage run: its outcome and seconds (setup, call, teardown)."""

    outcome: str
    seconds: float


@dataclass
class CoverageMap:
    """Per measured module, per function: the node ids of the tests that ran it."""

    key: str
    functions: dict[str, dict[str, list[str]]]
    tests: dict[str, TestRecord]
    # Seconds of the coverage run beyond its tests: what starting pytest once costs.
    session_seconds: float = 0.0
    request: dict[str, object] = field(default_factory=dict)
    # Per measured module, the lines some test ran (coverage.py's statement lines); absent: unknown.
    lines: dict[str, list[int]] = field(default_factory=dict)
    # Per measured module, per statement line (a string: JSON keys), the tests that ran it; absent: only
    # the function is known, and a mutant is judged by every test of its function.
    line_tests: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # What a later map may reuse this one by: the key of everything but the test files (``base_key``), and
    # each test file's digest; a map of older shape has neither and is never reused in part.
    base_key: str = ""
    test_files: dict[str, str] = field(default_factory=dict)

    def ran_line(self, module: str, source: str, line: int) -> bool:
        """Whether some test ran the statement holding ``line`` (True when the map does not know)."""
        if module not in self.lines:
            return True
        ran = set(self.lines[module])
        return any(at in ran for at in traced_lines(source, line))

    def tests_for(self, module: str, qualname: str) -> list[str]:
        """Return the green tests that ran ``module``'s ``qualname``, fastest first."""
        ran = self.functions.get(module, {}).get(qualname, [])
        green = [t for t in ran if t in self.tests and self.tests[t].outcome in GREEN]
        return sorted(green, key=lambda t: (self.tests[t].seconds, t))

    def tests_for_lines(self, module: str, source: str, lines: list[int], qualname: str,
                        first: tuple[str, ...] = ()) -> list[str]:
        """Return the green tests that ran one of ``lines`` (their statements) of ``module``: the tests that can
        see a change there. ``first`` (tests that killed a mutant of the same function before) lead, then
        fastest first. A map without per-line data gives every test of the function ``qualname``.

        Only a test that ran the changed statement can tell the change apart, so the others are not run: for
        a long function (``MessageQueue.enqueue``) most of its tests never reach a given branch.
        """
        per_line = self.line_tests.get(module)
        if per_line is None:
            green = self.tests_for(module, qualname)
        else:
            ran = {t for line in lines for at in traced_lines(source, line) for t in per_line.get(str(at), ())}
            green = sorted((t for t in ran if t in self.tests and self.tests[t].outcome in GREEN),
                           key=lambda t: (self.tests[t].seconds, t))
        lead = [t for t in first if t in green]
        return lead + [t for t in green if t not in lead]

    def judges_key(self, tests: list[str]) -> str:
        """Return what a verdict reached by ``tests`` rests on: everything but the test files
        (``base_key``), those tests' node ids and their files' digests. Equal keys: the same tests
        would judge the mutant again, so a survivor's verdict stands. "" for a map of older shape."""
        if not self.base_key:
            return ""
        names = sorted(set(tests))
        files = sorted({t.partition("::")[0] for t in names})
        return digest([self.base_key, *names, *(f"{f}={self.test_files.get(f, '')}" for f in files)])

    def seconds_for(self, tests: list[str]) -> float:
        """Return what running ``tests`` once costs: pytest's start and every test's seconds."""
        return self.session_seconds + sum(self.tests[t].seconds for t in tests if t in self.tests)

    def red(self) -> list[str]:
        """Return the tests that were not green in the coverage run (they judge no mutant)."""
        return sorted(t for t, r in self.tests.items() if r.outcome not in GREEN | {"skipped"})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CoverageMap":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> "CoverageMap":
        return cls(**{**data, "tests": {k: TestRecord(**v) for k, v in data["tests"].items()}})


@dataclass(frozen=True)
class CoverageRequest:
    """The tests the map is built from: pytest paths, ``-m`` and ``-k``."""

    paths: tuple[str, ...]
    marker: str = ""
    select: str = ""

    def pytest_args(self) -> list[str]:
        args = list(self.paths)
        if self.marker:
            args += ["-m", self.marker]
        if self.select:
            args += ["-k", self.select]
        return args


def digest(parts: list[str | bytes]) -> str:
    """Return a short digest of ``parts`` (in order)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def map_key(sources: dict[str, str], request: CoverageRequest, root: Path = REPO_ROOT) -> str:
    """Return the key of a map: measured sources, the request, and every test and testbed source file
    (but this tool's own: it does not change what the tests run)."""
    return digest(_key_parts(sources, request, root, test_files=True))


def base_key(sources: dict[str, str], request: CoverageRequest, root: Path = REPO_ROOT) -> str:
    """Return ``map_key`` without the test files (``test_*.py``): two maps with the same base differ only in
    tests, so a map can be built from another by measuring the test files that changed."""
    return digest(_key_parts(sources, request, root, test_files=False))


def test_file_digests(root: Path = REPO_ROOT) -> dict[str, str]:
    """Return each test file (``tests/**/test_*.py``, relative to ``root``) and its digest."""
    return {str(path.relative_to(root)): digest([path.read_bytes()])
            for path in sorted((root / "tests").rglob("test_*.py"))}


def _key_parts(sources: dict[str, str], request: CoverageRequest, root: Path, test_files: bool) -> list[str | bytes]:
    parts: list[str | bytes] = [MAP_FORMAT, json.dumps(asdict(request), sort_keys=True)]
    for module in sorted(sources):
        parts += [module, sources[module]]
    tool = root / "src/vllm_zerocopy_testbed/mutants"
    for folder in ("tests", "src/vllm_zerocopy_testbed"):
        for path in sorted((root / folder).rglob("*.py")):
            if tool in path.parents or (not test_files and folder == "tests" and path.name.startswith("test_")):
                continue
            parts += [str(path.relative_to(root)), path.read_bytes()]
    return parts


def functions_from_lines(module_source: str, contexts_by_line: dict[int, list[str]]) -> dict[str, list[str]]:
    """Return, per function of a source, the sorted contexts (tests) that ran a line of its body."""
    funcs = functions(module_source)
    by_function: dict[str, set[str]] = {}
    for line, contexts in contexts_by_line.items():
        owner = function_at(funcs, line)
        if owner == MODULE_LEVEL:
            continue
        by_function.setdefault(owner, set()).update(c for c in contexts if c)
    return {name: sorted(tests) for name, tests in sorted(by_function.items()) if tests}


def _write_harness(folder: Path, files: dict[str, Path]) -> Path:
    """Write the coverage run's ``sitecustomize.py`` and rc file into ``folder``; return the rc file."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".coverage*"):
        stale.unlink()
    (folder / "sitecustomize.py").write_text(
        _SITECUSTOMIZE % {"context": CONTEXT_ENV, "current": CURRENT_TEST_ENV})
    rc = folder / "coveragerc"
    include = "\n    ".join(str(p.resolve()) for p in files.values())
    rc.write_text(f"[run]\nparallel = True\ndata_file = {folder / '.coverage'}\ninclude =\n    {include}\n")
    return rc


PROGRESS = re.compile(r"\[\s*(\d+)%\]")  # pytest -q ends each line of dots with its share done
PROGRESS_EVERY_S = 60.0


def _run_with_progress(cmd: list[str], env: dict[str, str], log_path: Path, say: Callable[[str], None]) -> int:
    """Run ``cmd`` (its output to ``log_path``) within ``COVERAGE_RUN_TIMEOUT_S`` (``check.side``'s bounded
    runner: interrupted, then its session killed), saying every minute how far pytest is; return its exit
    status."""
    from vllm_zerocopy_testbed.check.side import run_bounded

    def tick(elapsed: float) -> None:
        done = PROGRESS.findall(log_path.read_text(errors="replace"))
        say(f"coverage map: {done[-1] + '% of the tests' if done else 'starting'} [{elapsed:.0f} s]")

    returncode, bound, *_ = run_bounded(cmd, env=env, log=log_path, bound_s=COVERAGE_RUN_TIMEOUT_S, tick=tick,
                                        tick_s=PROGRESS_EVERY_S)
    if bound or returncode is None:
        raise RuntimeError(f"the coverage run {bound or 'was killed'}: see {log_path}")
    return returncode


def build(files: dict[str, Path], request: CoverageRequest, folder: Path, key: str,
          say: Callable[[str], None] = log.info, partial: bool = False) -> CoverageMap:
    """Run ``request``'s tests under coverage in ``folder``; return the map of ``files`` (module -> path).
    ``partial``: some test files only (``load_or_build``); none of their tests requested is an empty map."""
    import coverage

    rc = _write_harness(folder, files)
    outcomes = folder / "outcomes.json"
    current = folder / "current-test"
    current.write_text("")
    env = {k: v for k, v in process_env().items() if k not in _mode_envs()}
    env.update({"COVERAGE_PROCESS_START": str(rc), CURRENT_TEST_ENV: str(current), OUTCOMES_ENV: str(outcomes),
                "PYTHONPATH": os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)})
    env.pop(CONTEXT_ENV, None)
    cmd = [sys.executable, "-m", "pytest", *request.pytest_args(), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-p", "vllm_zerocopy_testbed.mutants.coverage_plugin"]
    log.info("coverage run: %s", " ".join(cmd))
    started = time.monotonic()
    returncode = _run_with_progress(cmd, env, folder / "pytest.log", say)
    wall = time.monotonic() - started
    if partial and returncode == 5:  # pytest: no test collected
        return CoverageMap(key, {m: {} for m in files}, {}, 0.0, asdict(request), {m: [] for m in files},
                           {m: {} for m in files})
    if returncode not in (0, 1) or not outcomes.exists():
        raise RuntimeError(f"the coverage run ended with pytest status {returncode}: see {folder / 'pytest.log'}")
    say(f"coverage map: the tests ran in {wall:.0f} s; combining the per-test data")
    tests = {k: TestRecord(**v) for k, v in json.loads(outcomes.read_text()).items()}
    cov = coverage.Coverage(config_file=str(rc))
    cov.combine(data_paths=[str(folder)], keep=False)
    data = cov.get_data()
    measured = {str(Path(f).resolve()): f for f in data.measured_files()}
    by_module: dict[str, dict[str, list[str]]] = {}
    ran: dict[str, list[int]] = {}
    per_line: dict[str, dict[str, list[str]]] = {}
    for module, path in files.items():
        name = measured.get(str(path.resolve()))
        lines = data.contexts_by_lineno(name) if name else {}
        by_module[module] = functions_from_lines(path.read_text(), lines)
        ran[module] = sorted(line for line, contexts in lines.items() if any(contexts))
        per_line[module] = {str(line): sorted({c for c in contexts if c}) for line, contexts in sorted(lines.items())
                            if any(contexts)}
    session = max(0.0, wall - sum(r.seconds for r in tests.values()))
    return CoverageMap(key, by_module, tests, round(session, 1), asdict(request), ran, per_line)


def load_or_build(files: dict[str, Path], request: CoverageRequest, cache: Path,
                  say: Callable[[str], None] = log.info, root: Path = REPO_ROOT) -> tuple[CoverageMap, bool]:
    """Return the cached map for these sources and tests, and whether it was built now.

    Without one, a cached map that differs only in test files is the start: the changed and new test files
    are measured (a minute or two for one file) and their tests replace that map's; else every test runs
    (about 20 minutes on 2 cores).
    """
    sources = {m: p.read_text() for m, p in files.items()}
    key = map_key(sources, request, root)
    path = cache / f"coverage-{key}.json"
    if path.exists():
        return CoverageMap.from_json(path.read_text()), False
    base, digests = base_key(sources, request, root), test_file_digests(root)
    prior = _closest(cache, base, digests)
    if prior is None:
        cmap = build(files, request, cache / f"coverage-{key}", key, say)
    else:
        changed = {f for f, d in digests.items() if prior.test_files.get(f) != d}
        remeasured = changed | (set(prior.test_files) - set(digests))
        wanted = sorted(f for f in changed if _requested(f, request))
        say(f"coverage map: {prior.key} differs only in {len(remeasured)} test files: measuring "
            f"{' '.join(wanted) or 'none of them (none is requested)'}")
        part = (build(files, CoverageRequest(tuple(wanted), request.marker, request.select),
                      cache / f"coverage-{key}", key, say, partial=True) if wanted else None)
        cmap = merged(prior, part, remeasured, sources, key)
        cmap.request = asdict(request)
    cmap.base_key, cmap.test_files = base, digests
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(cmap.to_json())
    return cmap, True


def _requested(test_file: str, request: CoverageRequest) -> bool:
    """Whether ``request``'s paths hold ``test_file`` (a path relative to the repository)."""
    return any(test_file == p or test_file.startswith(p.rstrip("/") + "/") for p in request.paths)


def _closest(cache: Path, base: str, digests: dict[str, str]) -> CoverageMap | None:
    """Return the cached map with base key ``base`` whose test files differ least from ``digests``, or None."""
    best: tuple[int, float, dict] | None = None
    for path in cache.glob("coverage-*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("base_key") != base:
            continue
        files = data.get("test_files", {})
        differ = sum(files.get(f) != d for f, d in digests.items()) + len(set(files) - set(digests))
        rank = (differ, -path.stat().st_mtime)
        if best is None or rank < best[:2]:
            best = (*rank, data)
    return None if best is None else CoverageMap.from_dict(best[2])


def merged(prior: CoverageMap, part: CoverageMap | None, remeasured: set[str], sources: dict[str, str],
           key: str) -> CoverageMap:
    """Return ``prior`` with the tests of the files ``remeasured`` (changed, new or gone) replaced by ``part``'s
    (None: those files have no requested tests now); functions are derived again from the lines."""
    def kept(tests) -> set[str]:
        return {t for t in tests if t.partition("::")[0] not in remeasured}

    tests = {t: prior.tests[t] for t in kept(prior.tests)}
    line_tests: dict[str, dict[str, list[str]]] = {}
    for module in sources:
        per: dict[str, set[str]] = {line: kept(ts) for line, ts in prior.line_tests.get(module, {}).items()}
        if part is not None:
            for line, ts in part.line_tests.get(module, {}).items():
                per.setdefault(line, set()).update(ts)
        line_tests[module] = {line: sorted(ts) for line, ts in sorted(per.items(), key=lambda i: int(i[0])) if ts}
    if part is not None:
        tests.update(part.tests)
    return CoverageMap(
        key, {m: functions_from_lines(sources[m], {int(line): ts for line, ts in line_tests[m].items()})
              for m in sources},
        tests, prior.session_seconds, dict(prior.request), {m: [int(line) for line in line_tests[m]] for m in sources},
        line_tests)


def _mode_envs() -> frozenset[str]:
    from vllm_zerocopy_testbed.mutants.run import MODE_ENVS

    return MODE_ENVS
