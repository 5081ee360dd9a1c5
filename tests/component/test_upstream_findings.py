"""A finding's standalone repro, run as ``make upstream`` runs it: red on stock vLLM, green with its fix.diff.

Real vLLM, real repro processes, the fix served by the overlay; no part stood in for. One finding
(the fastest, ~7 s a run) keeps the runner honest in CI; ``make upstream`` runs them all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.upstream import run

pytestmark = [pytest.mark.component, pytest.mark.timeout(300)]

NAME = "prompt-embeds-nonfinite"


def test_the_repro_fails_on_stock_and_passes_with_its_fix(tmp_path: Path) -> None:
    finding = run.discover(only=[NAME])[0]
    verdict = run.run_one(finding, tmp_path)
    assert verdict.stock_result == run.REPRODUCES, verdict.stock
    assert verdict.stock.line.startswith("FAIL"), verdict.stock.line
    assert verdict.patched_result == run.FIXED, (verdict.patched, verdict.problem)
    assert verdict.loads >= 1  # the patched run imported the patched module, from the overlay
    assert verdict.ok


def test_a_diff_that_does_not_fix_the_bug_is_red(tmp_path: Path) -> None:
    """A fix.diff that applies but changes nothing that matters (a comment): the patched run fails."""
    folder = tmp_path / "findings" / NAME
    shutil.copytree(run.FINDINGS / NAME, folder)
    (folder / "fix.diff").write_text(
        "--- a/vllm/renderers/embed_utils.py\n+++ b/vllm/renderers/embed_utils.py\n"
        "@@ -1,3 +1,4 @@\n # SPDX-License-Identifier: Apache-2.0\n"
        " # SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n+# not a fix\n"
        " from io import BytesIO\n")
    verdict = run.run_one(run.discover(folder.parent)[0], tmp_path / "out")
    assert verdict.stock_result == run.REPRODUCES
    assert verdict.patched_result == run.NOT_FIXED, verdict.patched
    assert verdict.loads >= 1 and not verdict.ok
