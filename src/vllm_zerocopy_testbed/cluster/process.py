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


def signal_group(proc: "subprocess.Popen[bytes] | None", signum: int) -> bool:
    """Send ``signum`` to ``proc``'s process group if it still runs; whether it was sent."""
    if proc is None or proc.poll() is not None:
        return False
    os.killpg(proc.pid, signum)
    return True


def pause_group(proc: "subprocess.Popen[bytes] | None") -> bool:
    """Stop every process of ``proc``'s group (SIGSTOP); whether it was sent."""
    return signal_group(proc, signal.SIGSTOP)


def resume_group(proc: "subprocess.Popen[bytes] | None") -> bool:
    """Continue every process of ``proc``'s group (SIGCONT); whether it was sent."""
    return signal_group(proc, signal.SIGCONT)
