"""The base side's outcomes, kept between checks: a second check against the same base runs only the candidate.

The base is the same code check after check (a release, or a checkout's overlay hash), so its suites and
its e2e tier give the same outcomes until the base, the tests that judge it, or the testbed's own code
change. The key holds all three: the base's code id, the selection of tests, and a hash of every file
under ``tests/`` and ``src/`` plus ``pyproject.toml``. Speed is never taken from here: it is only a
measurement beside the other side in the same run (``check/speed.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

from vllm_zerocopy_testbed.check.compare import CaseOutcome
from vllm_zerocopy_testbed.check.resolve import Side
from vllm_zerocopy_testbed.check.side import ShmUse, SideRun
from vllm_zerocopy_testbed.config import REPO_ROOT

logger = logging.getLogger(__name__)

CACHE_DIR = REPO_ROOT / ".cache" / "check"
# What the base's outcomes depend on besides its own code: the tests and the testbed that runs them.
JUDGES = ("tests", "src/vllm_zerocopy_testbed", "pyproject.toml")


def testbed_hash(root: Path = REPO_ROOT) -> str:
    """A hash of every file that judges the base (tests, the testbed's code, its pins), by path and content."""
    digest = hashlib.sha256()
    for name in JUDGES:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()
                                                   and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def key(base: Side, step: str, selection: list[str], root: Path = REPO_ROOT) -> str:
    """The cache key of one step (``suites`` or ``e2e-<target>``) of ``base`` under this testbed."""
    digest = hashlib.sha256(json.dumps([base.code_id, step, sorted(selection), testbed_hash(root)]).encode())
    return f"{step}-{digest.hexdigest()[:20]}"


def load(name: str, cache_dir: Path = CACHE_DIR) -> SideRun | None:
    """The base's run saved under ``name``, or None (none saved, or unreadable: it is run again)."""
    path = cache_dir / f"{name}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["outcomes"] = [CaseOutcome(**o) for o in data["outcomes"]]
        data["shm"] = ShmUse(**data["shm"])
        return SideRun(**data)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring the saved base run %s (%s): running the base again", path, exc)
        return None


def save(name: str, run: SideRun, cache_dir: Path = CACHE_DIR) -> Path | None:
    """Keep ``run`` for the next check, unless it cannot be trusted (it hung, or the testbed failed)."""
    if run.bound_passed or run.error or not run.outcomes:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(run), indent=1))
    tmp.replace(path)
    return path
