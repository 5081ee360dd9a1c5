"""Process groups and sessions we started: stop (bounded: SIGTERM, a grace period, SIGKILL),
pause, resume, and every process of a session (a node: Ray gives each worker its own
process group, but it stays in the session of the ``ray start`` that spawned it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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


def _stat(pid: int) -> tuple[str, int] | None:
    """Return (state, session id) of ``pid`` from /proc, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[3])


def session_pids(sid: int) -> list[int]:
    """Return every live (not zombie) process of session ``sid``: what one node or server runs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == sid and stat[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return sorted(found)


def _signal_each(pids: list[int], signum: int) -> list[int]:
    """Send ``signum`` to each of ``pids``; return those it reached (one may be gone meanwhile)."""
    reached = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            reached.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return reached


def signal_session(sid: int, signum: int) -> list[int]:
    """Send ``signum`` to every process of session ``sid``; return the PIDs it reached."""
    return _signal_each(session_pids(sid), signum)


def kill_session(sid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of session ``sid`` until none is left (at most ``timeout`` s);
    return those still there then. For a child started with ``start_new_session`` whose own
    children outlive it (Ray's agents wait ~60 s before they notice their raylet is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = session_pids(sid)
        if not left or time.monotonic() >= deadline:
            return left
        _signal_each(left, signal.SIGKILL)
        time.sleep(0.05)


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (SIGSTOP: state T)."""
    stat = _stat(pid)
    return stat is not None and stat[0] == "T"


def command_line(pid: int) -> str:
    """Return ``pid``'s command line (Ray renames its workers': ``ray::RayWorkerProc``), or ""."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def signal_matching(sid: int, pattern: str, signum: int = signal.SIGKILL, count: int | None = None) -> list[int]:
    """Send ``signum`` to the processes of session ``sid`` whose command line contains ``pattern``
    (the first ``count`` by PID, or all); return the PIDs it reached."""
    matching = [pid for pid in session_pids(sid) if pattern in command_line(pid)]
    return _signal_each(matching if count is None else matching[:count], signum)
