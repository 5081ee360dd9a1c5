"""Stopping a process group we started, bounded: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: "subprocess.Popen[bytes] | None", grace_s: float = 20.0) -> None:
    """Stop ``proc``'s process group (started with ``start_new_session``) if it still runs."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
