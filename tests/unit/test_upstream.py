"""``make upstream``'s runner: which folders are findings, how a fix.diff becomes an overlay, how runs are judged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.upstream import run

pytestmark = pytest.mark.unit

EMBEDS = run.FINDINGS / "prompt-embeds-nonfinite"


def _copy(finding: Path, root: Path) -> Path:
    target = root / finding.name
    shutil.copytree(finding, target)
    return target


def test_every_finding_in_the_checkout_is_complete_and_capped_under_five_minutes() -> None:
    findings = run.discover()
    assert len(findings) >= 7
    for finding in findings:
        assert finding.cap_s + run.MARGIN_S <= 300 + run.MARGIN_S, finding.name
        assert finding.cap_s < 300, f"{finding.name}: a repro must end within 5 minutes on 2 cores"
        assert "vllm_zerocopy_testbed" not in finding.repro.read_text(), f"{finding.name} imports the testbed"
        assert run.diff_files(finding.diff), finding.name


def test_an_incomplete_finding_is_named_with_what_it_lacks(tmp_path: Path) -> None:
    folder = _copy(EMBEDS, tmp_path)
    (folder / "REPORT.md").unlink()
    with pytest.raises(run.FindingError, match=r"prompt-embeds-nonfinite: missing REPORT.md"):
        run.discover(tmp_path)


def test_an_unknown_name_lists_the_findings_there_are(tmp_path: Path) -> None:
    _copy(EMBEDS, tmp_path)
    with pytest.raises(run.FindingError, match=r"no finding named nope .*have: prompt-embeds-nonfinite"):
        run.discover(tmp_path, only=["nope"])


def test_a_file_that_is_not_a_diff_is_refused(tmp_path: Path) -> None:
    diff = tmp_path / "fix.diff"
    diff.write_text("just words\n")
    with pytest.raises(run.FindingError, match="not a unified diff"):
        run.diff_files(diff)
    diff.write_text("--- vllm/x.py\n+++ vllm/x.py\n")
    with pytest.raises(run.FindingError, match=r"expected paths as b/vllm/"):
        run.diff_files(diff)


def test_the_fix_is_applied_to_copies_and_served_by_an_overlay(tmp_path: Path) -> None:
    finding = run.discover(only=["prompt-embeds-nonfinite"])[0]
    diff, modules = run.build_patched(finding, tmp_path / "scratch")
    assert (diff, modules) == ("fix.diff", ["vllm.renderers.embed_utils"])
    served = (tmp_path / "scratch" / "overlay" / "vllm__renderers__embed_utils.py").read_text()
    assert "must be finite" in served
    installed = run.overlay.module_source("vllm.renderers.embed_utils").read_text()
    assert "must be finite" not in installed  # the installed release is never touched


def test_a_diff_for_other_code_is_an_error_naming_the_release(tmp_path: Path) -> None:
    folder = _copy(EMBEDS, tmp_path)
    diff = (folder / "fix.diff").read_text().replace("    return tensor\n", "    return tensor  # moved on\n", 1)
    (folder / "fix.diff").write_text(diff)
    finding = run.discover(tmp_path)[0]
    with pytest.raises(run.FindingError, match=r"fix.diff does not apply to vLLM \d"):
        run.build_patched(finding, tmp_path / "scratch")


def test_a_diff_for_a_later_release_serves_where_the_first_does_not_apply(tmp_path: Path) -> None:
    """fix.diff is for the release the finding was made on; fix-<release>.diff for one whose code moved."""
    folder = _copy(EMBEDS, tmp_path)
    good = (folder / "fix.diff").read_text()
    (folder / "fix-9.9.9.diff").write_text(good)
    (folder / "fix.diff").write_text(good.replace("    return tensor\n", "    return tensor  # moved on\n", 1))
    diff, _ = run.build_patched(run.discover(tmp_path)[0], tmp_path / "scratch")
    assert diff == "fix-9.9.9.diff"
    served = (tmp_path / "scratch" / "overlay" / "vllm__renderers__embed_utils.py").read_text()
    assert "must be finite" in served


@pytest.mark.parametrize(("returncode", "line", "stock", "patched"), [
    (1, "FAIL (vLLM 0.32.0): x", run.REPRODUCES, run.NOT_FIXED),
    (1, "HANG: y did not finish within 9 s", run.REPRODUCES, run.NOT_FIXED),
    (0, "OK (vLLM 0.32.0): z", run.NOT_REPRODUCED, run.FIXED),
    (2, "ERROR: cannot import", run.ERROR, run.ERROR),
    (-9, "killed by the runner", run.HANG, run.HANG),
    # a traceback exits 1 too: the repro never said the bug showed
    (1, "RuntimeError: Device string must not be empty", run.ERROR, run.ERROR),
    (0, "some other line", run.ERROR, run.ERROR),
])
def test_runs_are_judged_by_their_exit_status_and_line(returncode: int, line: str, stock: str, patched: str) -> None:
    result = run.Run(returncode, line, 1.0)
    assert run.judge_stock(result) == stock
    assert run.judge_patched(result, loads=1) == patched


def test_a_release_without_the_code_path_is_not_applicable_not_red() -> None:
    assert run.judge_stock(run.Run(3, "N/A (vLLM 0.34.0): no compiled-graph executor", 1.0)) == run.NOT_APPLICABLE
    verdict = run.Verdict("c", "0.34.0", stock=run.Run(3, "N/A x", 1.0), stock_result=run.NOT_APPLICABLE,
                          patched_result=run.NOT_APPLICABLE)
    assert verdict.ok
    row = run.markdown({"vllm": "0.34.0", "findings": [run.asdict(verdict)]}).splitlines()[-1]
    assert "not in this release: N/A x | - |" in row and "(red)" not in row


def test_a_patched_run_that_never_imported_the_fix_says_nothing() -> None:
    assert run.judge_patched(run.Run(0, "OK", 1.0), loads=0) == run.ERROR
    assert run.judge_patched(run.Run(0, "OK", 1.0), loads=1) == run.FIXED


def test_the_table_marks_what_is_not_as_the_finding_claims_red() -> None:
    good = run.Verdict("a", "0.32.0", stock=run.Run(1, "FAIL x", 3.0), patched=run.Run(0, "OK y", 2.0),
                       stock_result=run.REPRODUCES, patched_result=run.FIXED)
    gone = run.Verdict("b", "0.32.0", stock=run.Run(0, "OK z", 3.0), patched=run.Run(0, "OK z", 2.0),
                       stock_result=run.NOT_REPRODUCED, patched_result=run.FIXED)
    text = run.markdown({"vllm": "0.32.0", "findings": [run.asdict(good), run.asdict(gone)]})
    row_a, row_b = (line for line in text.splitlines() if line.startswith("| [a]") or line.startswith("| [b]"))
    assert "(red)" not in row_a and "reproduces: FAIL x" in row_a
    assert "**no longer reproduces** (red): OK z" in row_b
    assert good.ok and not gone.ok
