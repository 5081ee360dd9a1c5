"""pytest plugin of the coverage run (``-p``): labels what each test runs with its node id, records its outcome.

The label goes three ways, so every process a test starts carries it: coverage's dynamic context
in this process, an environment variable that spawned processes inherit, and a file that forked
children of a long-lived fork server read (``coverage_map``'s ``sitecustomize.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from vllm_zerocopy_testbed.mutants.coverage_map import CONTEXT_ENV, CURRENT_TEST_ENV, OUTCOMES_ENV

_records: dict[str, dict[str, Any]] = {}


def _label(nodeid: str) -> None:
    import coverage

    os.environ[CONTEXT_ENV] = nodeid
    if CURRENT_TEST_ENV in os.environ:
        Path(os.environ[CURRENT_TEST_ENV]).write_text(nodeid)
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _label(item.nodeid)
    yield
    _label("")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _records.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    record["seconds"] = round(record["seconds"] + report.duration, 3)
    if report.failed:
        record["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and record["outcome"] == "passed":
        record["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        Path(path).write_text(json.dumps(_records, indent=1, sort_keys=True))
