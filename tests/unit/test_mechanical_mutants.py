"""The mechanical mutants' judge: which function a mutation changed, which tests ran it, which operators apply."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.mutants import coverage_map as cm
from vllm_zerocopy_testbed.mutants import mechanical, run

pytestmark = pytest.mark.unit

SOURCE = textwrap.dedent('''\
    """A module."""
    LIMIT = 4


    class Ring:
        size = 8

        def acquire(self, n):
            if n > LIMIT:
                return None

            def inner(x):
                return x + 1

            return inner(n)

        @property
        def free(self):
            return self.size - 1


    def top(a, b=LIMIT + 1):
        return a * b
    ''')


def _mutate(old: str, new: str) -> str:
    assert SOURCE.count(old) == 1
    return SOURCE.replace(old, new)


@pytest.mark.parametrize(("old", "new", "function"), [
    ("if n > LIMIT:", "if n >= LIMIT:", "Ring.acquire"),
    ("return None", "return 0", "Ring.acquire"),
    ("return inner(n)", "return None", "Ring.acquire"),
    ("return x + 1", "return x - 1", "Ring.acquire.inner"),
    ("return self.size - 1", "return self.size + 1", "Ring.free"),
    ("return a * b", "return a // b", "top"),
    ("LIMIT = 4", "LIMIT = 5", cm.MODULE_LEVEL),
    ("size = 8", "size = 9", cm.MODULE_LEVEL),
    # Default values and decorators run with the enclosing scope, not the function.
    ("b=LIMIT + 1", "b=LIMIT - 1", cm.MODULE_LEVEL),
])
def test_the_judge_maps_a_diff_to_the_function_it_changed(old: str, new: str, function: str) -> None:
    assert cm.changed_function(SOURCE, _mutate(old, new)) == function


def test_a_deleted_line_and_a_two_line_change_are_placed_too() -> None:
    deleted = _mutate("        if n > LIMIT:\n            return None\n", "")
    assert cm.changed_function(SOURCE, deleted) == "Ring.acquire"
    assert cm.changed_lines(SOURCE, deleted) == [9, 10]


def test_the_judge_refuses_no_change_and_a_change_across_functions() -> None:
    with pytest.raises(ValueError, match="pristine"):
        cm.changed_function(SOURCE, SOURCE)
    both = _mutate("return self.size - 1", "return self.size + 1").replace("return a * b", "return a + b")
    with pytest.raises(ValueError, match="several functions"):
        cm.changed_function(SOURCE, both)


def test_functions_own_their_body_lines_but_not_their_nested_functions() -> None:
    funcs = {f.qualname: f for f in cm.functions(SOURCE)}
    assert set(funcs) == {"Ring.acquire", "Ring.acquire.inner", "Ring.free", "top"}
    acquire = funcs["Ring.acquire"]
    assert acquire.owns(9) and acquire.owns(15) and not acquire.owns(13) and not acquire.owns(8)


def test_coverage_lines_become_per_function_test_lists() -> None:
    lines = {2: ["t::a", "t::b"], 8: ["t::a"], 9: ["t::a", ""], 13: ["t::b"], 19: ["t::c"], 23: ["t::a", "t::c"]}
    assert cm.functions_from_lines(SOURCE, lines) == {
        "Ring.acquire": ["t::a"], "Ring.acquire.inner": ["t::b"], "Ring.free": ["t::c"], "top": ["t::a", "t::c"]}


def _map() -> cm.CoverageMap:
    tests = {"t::slow": cm.TestRecord("passed", 9.0), "t::fast": cm.TestRecord("passed", 1.0),
             "t::known": cm.TestRecord("xfailed", 2.0), "t::red": cm.TestRecord("failed", 3.0),
             "t::skip": cm.TestRecord("skipped", 0.0)}
    functions = {"m": {"f": ["t::slow", "t::fast", "t::known", "t::red", "t::skip", "t::gone"], "g": ["t::red"]}}
    return cm.CoverageMap("k", functions, tests, session_seconds=5.0)


def test_the_map_names_the_green_tests_of_a_function_fastest_first() -> None:
    cmap = _map()
    assert cmap.tests_for("m", "f") == ["t::fast", "t::known", "t::slow"]
    assert cmap.tests_for("m", "g") == []  # only a red test ran it: uncovered, not judged by a red test
    assert cmap.tests_for("m", "h") == [] and cmap.tests_for("other", "f") == []
    assert cmap.seconds_for(cmap.tests_for("m", "f")) == 5.0 + 12.0
    assert cmap.red() == ["t::red"]


def test_a_mutant_is_judged_by_the_tests_that_ran_its_statement_killers_first() -> None:
    source = "def f(x):\n    g(\n        x + 1,\n    )\n    if x:\n        return 1\n"
    cmap = _map()
    cmap.line_tests = {"m": {"2": ["t::slow", "t::red"], "5": ["t::fast", "t::slow", "t::known"], "6": ["t::known"]}}
    assert cmap.tests_for_lines("m", source, [3], "f") == ["t::slow"]  # line 3 is the statement of line 2
    assert cmap.tests_for_lines("m", source, [6], "f") == ["t::known"]
    assert cmap.tests_for_lines("m", source, [5], "f") == ["t::fast", "t::known", "t::slow"]
    assert cmap.tests_for_lines("m", source, [5], "f", first=("t::slow", "t::gone")) == [
        "t::slow", "t::fast", "t::known"]
    assert cmap.tests_for_lines("other", source, [5], "f") == []  # no per-line data: the function's (none)
    cmap.line_tests = {}
    assert cmap.tests_for_lines("m", source, [6], "f") == ["t::fast", "t::known", "t::slow"]


def test_junit_names_map_back_to_node_ids() -> None:
    tests = ["tests/component/test_ring.py::test_a[upstream]", "tests/unit/test_x.py::TestY::test_a[upstream]"]
    assert mechanical.node_id("test_ring::test_a[upstream]", tests) == tests[0]
    assert mechanical.node_id("TestY::test_a[upstream]", tests) == tests[1]  # a class's tests: the class
    assert mechanical.node_id("test_ring::test_b", tests) == "" and mechanical.node_id("timeout", tests) == ""


def test_the_map_round_trips_through_json() -> None:
    cmap = _map()
    assert cm.CoverageMap.from_json(cmap.to_json()) == cmap


def test_the_map_key_follows_the_sources_and_the_request(tmp_path: Path) -> None:
    for folder in ("tests", "src/vllm_zerocopy_testbed"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tests" / "test_x.py").write_text("x = 1\n")
    request = cm.CoverageRequest(("tests/test_x.py",), "", "upstream")
    key = cm.map_key({"m": SOURCE}, request, tmp_path)
    assert key == cm.map_key({"m": SOURCE}, request, tmp_path)
    assert key != cm.map_key({"m": SOURCE + "#\n"}, request, tmp_path)
    assert key != cm.map_key({"m": SOURCE}, cm.CoverageRequest(("tests/test_x.py",)), tmp_path)
    (tmp_path / "tests" / "test_x.py").write_text("x = 2\n")
    assert key != cm.map_key({"m": SOURCE}, request, tmp_path)


def test_the_operator_set_is_the_meaningful_subset() -> None:
    names = {n.split("/", 1)[1] for n in mechanical.operator_names()}
    assert {"ReturnNone", "RemoveCall", "NumberReplacer", "AddNot", "ReplaceBreakWithContinue",
            "ReplaceComparisonOperator_Lt_LtE", "ReplaceBinaryOperator_Add_Sub"} <= names
    assert "ReplaceComparisonOperator_Lt_Is" not in names and "ReplaceBinaryOperator_Add_Pow" not in names
    assert not {"VariableReplacer", "VariableInserter", "ExceptionReplacer", "RemoveDecorator"} & names


@pytest.mark.parametrize(("operator", "old", "new"), [
    ("ReturnNone", "return a * b", "return None"),
    ("RemoveCall", "        g(1)\n", "        pass\n"),
])
def test_our_operators_change_what_they_say(operator: str, old: str, new: str) -> None:
    from cosmic_ray.mutating import mutate_code

    import cosmic_ray.plugins

    source = SOURCE.replace("        return self.size - 1\n", "        g(1)\n        return self.size - 1\n")
    mechanical._install_provider()
    op = cosmic_ray.plugins.get_operator(f"testbed/{operator}")()
    mutants = [m for m in (mutate_code(source, op, i) for i in range(20)) if m is not None]
    assert any(m == source.replace(old, new, 1) for m in mutants), mutants[:2]
    if operator == "ReturnNone":  # `return None` is left alone: no mutant that changes nothing
        assert all(m != source for m in mutants) and len(mutants) == source.count("return ") - 1


def test_a_detach_target_selects_the_detach_and_its_call_sites_only() -> None:
    source = textwrap.dedent('''\
        def detach(out):
            def copy(a):
                return a
            return copy(out)

        class Future:
            def result(self):
                detach(self.x)
                return self.x

        def other():
            return 1
        ''')
    target = mechanical.Target("m", calling="detach")
    assert [f for f in ("detach", "detach.copy", "Future.result", "other") if target.selects(source, f)] == [
        "detach", "detach.copy", "Future.result"]


def test_a_judged_mutant_is_killed_survives_or_is_uncovered(tmp_path: Path, monkeypatch) -> None:
    """``judge_one`` applies the mutant in a scratch overlay and runs exactly the map's tests for its function."""
    module = "vllm_zerocopy_testbed.mutants.coverage_map"  # any importable module serves as the target
    pristine = Path(cm.__file__).read_text()
    session = mechanical.Session(tmp_path, {module: pristine})
    line = next(i for i, text in enumerate(pristine.splitlines(), 1) if "return owners[-1].qualname" in text)
    occurrence = _occurrence_of(pristine, "testbed/ReturnNone", line)
    planned = mechanical.Planned("job", module, "function_at", "testbed/ReturnNone", occurrence, line)
    cmap = cm.CoverageMap("k", {module: {"function_at": ["t::a"]}}, {"t::a": cm.TestRecord("passed", 1.0)})
    seen: list[tuple] = []

    def fake_run(tests, select, workdir, pythonpath):
        seen.append((tests, pythonpath))
        (workdir / "loads.log").write_text(f"1 {module}\n")
        return run.Outcome(1, 2.0, "t::a", "AssertionError")

    verdict = mechanical.judge_one(planned, session, cmap, tmp_path / "scratch", run_tests=fake_run)
    assert (verdict.fate, verdict.function, verdict.killed_by) == (mechanical.KILLED, "function_at", "t::a")
    assert verdict.change == "return owners[-1].qualname if owners else MODULE_LEVEL -> return None"
    assert seen == [(("t::a",), tmp_path / "scratch")]
    assert "return None" in (tmp_path / "scratch" / (module.replace(".", "__") + ".py")).read_text()
    assert pristine == Path(cm.__file__).read_text()  # never in place
    uncovered = mechanical.judge_one(planned, session, cm.CoverageMap("k", {}, {}), tmp_path / "s2",
                                     run_tests=fake_run)
    assert uncovered.fate == mechanical.UNCOVERED and len(seen) == 1


def _occurrence_of(source: str, operator: str, line: int) -> int:
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    mechanical._install_provider()
    op = cosmic_ray.plugins.get_operator(operator)()
    for occurrence in range(500):
        mutated = mutate_code(source, op, occurrence)
        assert mutated is not None, "no such mutation"
        if cm.changed_lines(source, mutated) == [line]:
            return occurrence
    raise AssertionError("not found")


def test_scores_count_per_function_and_leave_out_equivalents_and_errors() -> None:
    def v(function: str, fate: str) -> mechanical.Verdict:
        return mechanical.Verdict("j", "a.shm", function, "op", 1, "x -> y", fate)

    found = [v("f", mechanical.KILLED), v("f", mechanical.KILLED), v("f", mechanical.SURVIVED),
             v("f", mechanical.EQUIV), v("g", mechanical.ERROR), v("g", mechanical.UNCOVERED)]
    table = mechanical.scores(found)
    assert mechanical.score(table["a.shm"]["f"]) == pytest.approx(2 / 3)
    assert mechanical.score(table["a.shm"]["g"]) == 0.0
    md = mechanical.markdown({"summary": {}, "scores": table, "mutants": [
        {**vars(x), "key": x.key} for x in found]})
    assert "| shm | `f` | 2 | 1 | 0 | 1 | 0 | 67% |" in md and "`shm::f::x -> y`" in md


def test_a_changed_line_maps_to_the_statement_coverage_records() -> None:
    source = "def f(x):\n    g(\n        x + 1,\n    )\n    if (x and\n            x > 2):\n        return 1\n"
    assert [min(cm.traced_lines(source, n)) for n in (2, 3, 4, 5, 6, 7)] == [2, 2, 2, 5, 5, 7]
    cmap = cm.CoverageMap("k", {}, {}, lines={"m": [2, 5]})
    assert cmap.ran_line("m", source, 3) and not cmap.ran_line("m", source, 7)
    assert cmap.ran_line("other", source, 7)  # a map that does not know says yes: the tests decide


def test_a_mutant_on_a_line_no_test_ran_is_uncovered_without_a_run(tmp_path: Path) -> None:
    module = "vllm_zerocopy_testbed.mutants.coverage_map"
    pristine = Path(cm.__file__).read_text()
    line = next(i for i, text in enumerate(pristine.splitlines(), 1) if "return owners[-1].qualname" in text)
    planned = mechanical.Planned("job", module, "function_at", "testbed/ReturnNone",
                                 _occurrence_of(pristine, "testbed/ReturnNone", line), line)
    cmap = cm.CoverageMap("k", {module: {"function_at": ["t::a"]}}, {"t::a": cm.TestRecord("passed", 1.0)},
                          lines={module: [line - 1]})

    def no_run(*args, **kwargs):
        raise AssertionError("a mutant on a line no test ran is not run")

    verdict = mechanical.judge_one(planned, mechanical.Session(tmp_path, {module: pristine}), cmap,
                                   tmp_path / "scratch", run_tests=no_run)
    assert verdict.fate == mechanical.UNCOVERED and "changed line" in verdict.message


def test_equivalence_patterns_match_whole_keys_with_star_only() -> None:
    table = {"shm::f::a[0 : n], -> *": "why", "shm::g::x -> y": "because"}
    assert mechanical.equivalent_reason("shm::f::a[0 : n], -> a[1 : n],", table) == "why"
    assert mechanical.equivalent_reason("shm::f::a[0 : m], -> a[1 : n],", table) == ""  # "[" is literal
    assert mechanical.equivalent_reason("shm::g::x -> y", table) == "because"
    assert mechanical.equivalent_reason("shm::g::x -> yz", table) == ""


def test_the_coverage_run_says_how_far_it_is_while_it_runs(tmp_path, monkeypatch) -> None:
    """The coverage run takes about 20 minutes on 2 cores: it says its share of the tests every minute."""
    import sys

    from vllm_zerocopy_testbed.mutants import coverage_map

    monkeypatch.setattr(coverage_map, "PROGRESS_EVERY_S", 0.2)
    said: list[str] = []
    script = "import sys, time; print('..... [ 40%]', flush=True); time.sleep(1.5)"
    status = coverage_map._run_with_progress([sys.executable, "-c", script], {}, tmp_path / "log", said.append)
    assert status == 0
    assert any(line.startswith("coverage map: 40% of the tests [") for line in said), said


def test_a_change_on_a_line_of_a_multi_line_condition_is_seen_by_the_tests_that_ran_the_condition() -> None:
    """coverage.py traces a condition spread over lines line by line and never its ``if (`` line: a
    change on either is judged by the tests that ran the condition (once read as uncovered: vLLM's
    ``_reduce_tensor`` tests the tensor on three lines under an ``if (``)."""
    source = "def f(x):\n    if (\n        x\n        and x > 2\n    ):\n        return 1\n    return 0\n"
    cmap = cm.CoverageMap("k", {"m": {"f": ["t::a"]}}, {"t::a": cm.TestRecord("passed", 1.0)},
                          lines={"m": [3, 4, 6]}, line_tests={"m": {"3": ["t::a"], "4": ["t::a"], "6": ["t::a"]}})
    for line in (2, 3, 4, 5):  # the head of the if, its ``if (`` line included
        assert cmap.ran_line("m", source, line), line
        assert cmap.tests_for_lines("m", source, [line], "f") == ["t::a"], line
    assert not cmap.ran_line("m", source, 7)  # the last return never ran


def test_a_survivor_judged_under_other_tests_is_judged_again_and_a_killed_one_is_not() -> None:
    """A test written for a survivor changes the coverage map: the survivor (and an uncovered mutant) is
    judged again by the next run; a mutant already killed stays killed."""
    import json
    from types import SimpleNamespace

    def result(fate: str, key: str) -> SimpleNamespace:
        return SimpleNamespace(output=json.dumps({"fate": fate, "map_key": key}))

    db = SimpleNamespace(results=[("a", result(mechanical.SURVIVED, "old")), ("b", result(mechanical.UNCOVERED, "old")),
                                  ("c", result(mechanical.KILLED, "old")), ("d", result(mechanical.SURVIVED, "new")),
                                  ("e", SimpleNamespace(output=json.dumps({"fate": mechanical.SURVIVED})))])
    assert mechanical.stale(db, "new") == {"a", "b", "e"}


def _tree(root: Path, **tests: str) -> None:
    for folder in ("tests/component", "src/vllm_zerocopy_testbed"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "tests" / "conftest.py").write_text("# shared\n")
    for name, text in tests.items():
        (root / "tests" / "component" / f"{name}.py").write_text(text)


def test_the_base_key_leaves_out_test_files_only(tmp_path: Path) -> None:
    _tree(tmp_path, test_a="a = 1\n")
    request = cm.CoverageRequest(("tests",), "unit or component")
    key, base = cm.map_key({"m": SOURCE}, request, tmp_path), cm.base_key({"m": SOURCE}, request, tmp_path)
    (tmp_path / "tests" / "component" / "test_a.py").write_text("a = 2\n")
    assert cm.map_key({"m": SOURCE}, request, tmp_path) != key
    assert cm.base_key({"m": SOURCE}, request, tmp_path) == base
    assert list(cm.test_file_digests(tmp_path)) == ["tests/component/test_a.py"]
    (tmp_path / "tests" / "conftest.py").write_text("# shared, changed\n")  # every test may run otherwise now
    assert cm.base_key({"m": SOURCE}, request, tmp_path) != base


def test_a_map_is_built_from_one_that_differs_in_test_files_by_measuring_those_alone(tmp_path, monkeypatch) -> None:
    """After a new test, the map takes a minute or two (its file's tests), not the twenty of every test."""
    root, cache = tmp_path / "repo", tmp_path / "cache"
    _tree(root, test_a="a = 1\n", test_b="b = 1\n", test_c="c = 1\n")
    module = root / "m.py"
    module.write_text(SOURCE)
    request = cm.CoverageRequest(("tests",), "unit or component")
    runs: list[tuple[tuple[str, ...], bool]] = []

    def fake_build(files, req, folder, key, say=None, partial=False):
        runs.append((req.paths, partial))
        if not partial:  # a: lines 8 and 9 (Ring.acquire), b: 19 (Ring.free), c: 23 (top)
            line_tests = {"8": ["tests/component/test_a.py::t1"], "9": ["tests/component/test_a.py::t1"],
                          "19": ["tests/component/test_b.py::t2"], "23": ["tests/component/test_c.py::t3"]}
            tests = {t: cm.TestRecord("passed", 1.0) for t in ("tests/component/test_a.py::t1",
                                                               "tests/component/test_b.py::t2",
                                                               "tests/component/test_c.py::t3")}
            return cm.CoverageMap(key, cm.functions_from_lines(SOURCE, {int(k): v for k, v in line_tests.items()}),
                                  tests, 20.0, {}, {}, {"m": line_tests})
        # the changed a: its new test runs Ring.free only; the new file d's test runs top
        line_tests = {"19": ["tests/component/test_a.py::t1b"], "23": ["tests/component/test_d.py::t4"]}
        tests = {"tests/component/test_a.py::t1b": cm.TestRecord("passed", 2.0),
                 "tests/component/test_d.py::t4": cm.TestRecord("failed", 3.0)}
        return cm.CoverageMap(key, {}, tests, 0.0, {}, {}, {"m": line_tests})

    monkeypatch.setattr(cm, "build", fake_build)
    first, built = cm.load_or_build({"m": module}, request, cache, root=root)
    assert built and runs == [(("tests",), False)]
    assert cm.load_or_build({"m": module}, request, cache, root=root) == (first, False)  # the same tree: cached
    (root / "tests" / "component" / "test_a.py").write_text("a = 2\n")
    (root / "tests" / "component" / "test_d.py").write_text("d = 1\n")
    (root / "tests" / "component" / "test_c.py").unlink()
    said: list[str] = []
    second, built = cm.load_or_build({"m": module}, request, cache, said.append, root=root)
    assert built and runs[1:] == [(("tests/component/test_a.py", "tests/component/test_d.py"), True)]
    assert sorted(second.tests) == ["tests/component/test_a.py::t1b", "tests/component/test_b.py::t2",
                                    "tests/component/test_d.py::t4"]
    assert second.line_tests["m"] == {"19": ["tests/component/test_a.py::t1b", "tests/component/test_b.py::t2"],
                                      "23": ["tests/component/test_d.py::t4"]}
    assert second.functions["m"] == {"Ring.free": ["tests/component/test_a.py::t1b", "tests/component/test_b.py::t2"],
                                     "top": ["tests/component/test_d.py::t4"]}
    assert second.lines["m"] == [19, 23] and second.session_seconds == 20.0
    assert second.key == cm.map_key({"m": SOURCE}, request, root) and second.key != first.key
    assert "differs only in 3 test files" in said[0], said
    (root / "tests" / "conftest.py").write_text("# changed\n")  # not a test file: every test again
    cm.load_or_build({"m": module}, request, cache, root=root)
    assert runs[2:] == [(("tests",), False)]


def test_a_survivor_out_of_reach_here_says_why_and_the_others_read_unexplained() -> None:
    """A survivor no test on this machine can see (a store fence on x86-64, a CUDA-only branch) stays open,
    with its reason beside it; every other survivor counts as unexplained."""
    fence = mechanical.Verdict("j", "vllm.x.shm_broadcast", "Q.f", "op", 1, "memory_fence() -> pass",
                               mechanical.SURVIVED)
    other = mechanical.Verdict("k", "vllm.x.shm_broadcast", "Q.f", "op", 2, "x = 1 -> x = 2", mechanical.SURVIVED)
    md = mechanical.markdown({"summary": {}, "scores": mechanical.scores([fence, other]),
                              "mutants": [{**vars(x), "key": x.key} for x in (fence, other)]})
    assert "## Open survivors (2: 1 unexplained)" in md
    assert "`shm_broadcast::Q.f::memory_fence() -> pass` (op, line 1, 0 tests): out of reach here: " in md
    assert "`shm_broadcast::Q.f::x = 1 -> x = 2` (op, line 2, 0 tests)\n" in md


def test_a_mutant_killed_though_argued_equivalent_is_named_with_its_failure() -> None:
    """A kill of a mutant ``EQUIVALENT`` argues changes nothing is a flaky test or a wrong argument: the
    report names it and its failure (seen: a writer test's long-wait count, 0 for 2, under a reader-only
    mutant); a plain kill is not listed."""
    argued = mechanical.Verdict("j", "vllm.x.shm_broadcast", "Q.f", "op", 1, "return False -> return None",
                                mechanical.KILLED, killed_by="test_w", message="AssertionError: 0 lines",
                                equivalent="None is as false")
    plain = mechanical.Verdict("k", "vllm.x.shm_broadcast", "Q.f", "op", 2, "x = 1 -> x = 2", mechanical.KILLED,
                               killed_by="test_v", message="boom")
    md = mechanical.markdown({"summary": {}, "scores": mechanical.scores([argued, plain]),
                              "mutants": [{**vars(x), "key": x.key} for x in (argued, plain)]})
    assert "## Killed though argued equivalent" in md
    assert "- `shm_broadcast::Q.f::return False -> return None`: by `test_w`: AssertionError: 0 lines" in md
    assert "x = 1 -> x = 2" not in md.partition("## Killed though argued equivalent")[2]


def test_a_survivor_stands_while_the_tests_of_its_lines_are_the_same(tmp_path: Path) -> None:
    """A test written for one function changes the map's key, but a survivor of another function whose
    lines the same tests (same files) ran keeps its verdict; a new test over its lines, or a change
    outside the test files, judges it again."""
    import json
    from types import SimpleNamespace

    tests = {t: cm.TestRecord("passed", 1.0) for t in ("tests/test_a.py::x", "tests/test_b.py::y")}
    line_tests = {"m": {"9": ["tests/test_a.py::x"], "10": ["tests/test_a.py::x"]}}

    def cmap(key: str, base: str = "base", b_digest: str = "b1", line_10=("tests/test_a.py::x",)) -> cm.CoverageMap:
        return cm.CoverageMap(key, {"m": {"Ring.acquire": ["tests/test_a.py::x"]}}, tests, lines={"m": [9, 10]},
                              line_tests={"m": {**line_tests["m"], "10": list(line_10)}}, base_key=base,
                              test_files={"tests/test_a.py": "a1", "tests/test_b.py": b_digest})

    old = cmap("old")
    judged = old.judges_key(old.tests_for_lines("m", SOURCE, [10], "Ring.acquire"))
    verdict = {"fate": mechanical.SURVIVED, "map_key": "old", "module": "m", "function": "Ring.acquire",
               "lines": [10], "judges": judged}
    db = SimpleNamespace(results=[("s", SimpleNamespace(output=json.dumps(verdict))),
                                  ("u", SimpleNamespace(output=json.dumps({**verdict, "judges": ""})))])
    sources = {"m": SOURCE}
    assert mechanical.same_judges(db, cmap("new", b_digest="b2"), sources) == {"s"}  # test_b changed
    assert mechanical.same_judges(db, cmap("new", line_10=("tests/test_a.py::x", "tests/test_b.py::y")),
                                  sources) == set()  # a new test reaches line 10
    assert mechanical.same_judges(db, cmap("new", base="other"), sources) == set()  # the testbed changed
    assert mechanical.same_judges(db, cmap("old"), sources) == set()  # not stale: nothing to keep
