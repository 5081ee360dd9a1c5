"""Machine-wide locks on what two runs side by side cannot share: a compose project with its ports and
network, the local Ray cluster's fixed ports. One ``flock``-ed file per name in ``LOCK_DIR``; the
process that holds it owns the thing for its life, and the kernel drops the lock when that process
ends, however it ends. Two clones of the repository share Docker and the ports: hence /tmp, not the
repository."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import IO

LOCK_DIR = Path("/tmp/testbed-locks")
_HELD: dict[str, IO[str]] = {}  # name -> the open lock file this process holds


def _path(name: str) -> Path:
    LOCK_DIR.mkdir(mode=0o777, exist_ok=True)
    return LOCK_DIR / f"{name}.lock"


def hold(name: str) -> bool:
    """Take ``name``'s lock for this process's life, without waiting; whether we hold it."""
    if name in _HELD:
        return True
    lock = open(_path(name), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return False
    lock.seek(0)
    lock.truncate()
    report = os.environ.get("TESTBED_REPORT_DIR")
    lock.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:160]}" + (f" (report {report}/)" if report else "") + "\n")
    lock.flush()
    _HELD[name] = lock
    return True


def release(name: str) -> None:
    """Drop ``name``'s lock if this process holds it."""
    lock = _HELD.pop(name, None)
    if lock is not None:
        lock.close()


def is_free(name: str) -> bool:
    """Whether no live process holds ``name`` (we do not count: we hold what we hold)."""
    if name in _HELD:
        return False
    with open(_path(name), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


def holder(name: str) -> str:
    """Who holds ``name``, as it wrote itself down."""
    try:
        return _path(name).read_text().strip() or "unknown"
    except OSError:
        return "unknown"
