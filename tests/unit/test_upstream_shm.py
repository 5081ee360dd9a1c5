"""``make upstream`` leaves /dev/shm as it found it: what a repro's processes made there is removed
when the repro ends, also when they were killed; another process's entries stay.

Real processes and real POSIX semaphores, named as Ray's compiled-graph channels name theirs
(``sem_open("/hdr<pid>-<n>")``, ``/obj<pid>-<n>``, closed after use so no reading sees them mapped):
a stand-in repro starts two workers in its session, each in a process group of its own (as Ray's
are), kills one with SIGKILL itself (as the compiled-graph repro's stuck teardown does) and leaves
the other for the runner to kill. Meanwhile a process of no run makes a semaphore of the same kind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.cluster.shm import SHM_DIR
from vllm_zerocopy_testbed.upstream import run

pytestmark = pytest.mark.unit

# Makes sem.<kind><pid>-0 for each kind with libc's sem_open, closes them (unmapped), touches the file
# argv[3] names (if any), says its PID and waits to be killed: nobody unlinks them, as when Ray's
# workers are SIGKILLed.
MAKER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.sem_open.restype = ctypes.c_void_p
libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
libc.sem_close.argtypes = [ctypes.c_void_p]
for kind in sys.argv[1].split(","):
    sem = libc.sem_open(f"/{kind}{os.getpid()}-0".encode(), os.O_CREAT | os.O_EXCL, 0o600, 0)
    if sem in (None, ctypes.c_void_p(-1).value):
        sys.exit(f"sem_open: errno {ctypes.get_errno()}")
    libc.sem_close(sem)
if len(sys.argv) > 3:
    open(sys.argv[3], "w").close()
print(os.getpid(), flush=True)
time.sleep(float(sys.argv[2]))
"""

# The stand-in repro: its workers make their semaphores and say their PIDs in ``made``; it waits for
# the other process's semaphore (``other``) so that one is made while the run goes on, kills its
# first worker after ``HOLD_S`` (long enough for the runner to have seen it alive), and leaves.
REPRO = f"""
import os, signal, subprocess, sys, time
from pathlib import Path
MAKER = {MAKER!r}
CAP_S = 30
workers = [subprocess.Popen([sys.executable, "-c", MAKER, "hdr,obj", "600"], stdout=subprocess.PIPE, text=True,
                            process_group=0) for _ in range(2)]
pids = [w.stdout.readline().strip() for w in workers]
Path("made").write_text(" ".join(pids))
deadline = time.monotonic() + 20
while not Path("other").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(float(os.environ.get("HOLD_S", "0")))
os.kill(workers[0].pid, signal.SIGKILL)
workers[0].wait()
print("FAIL: the stand-in left a worker running", flush=True)
os._exit(1)
"""


def _sem_names(pid: int) -> list[str]:
    return [f"sem.hdr{pid}-0", f"sem.obj{pid}-0"]


def test_a_repros_semaphores_are_removed_after_its_processes_are_killed_and_no_other(
        tmp_path: Path, shm_names: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "findings" / "stand-in"
    folder.mkdir(parents=True)
    (folder / "repro.py").write_text(REPRO)
    finding = run.Finding("stand-in", folder, cap_s=30)
    workdir = tmp_path / "out" / "stock"
    workdir.mkdir(parents=True)
    # Another run's process: it makes its semaphore once the repro's workers have made theirs.
    other = subprocess.Popen(
        [sys.executable, "-c", f"import pathlib, time\n"
                               f"while not pathlib.Path({str(workdir / 'made')!r}).exists(): time.sleep(0.05)\n"
                               f"exec({MAKER!r})", "hdr", "600", str(workdir / "other")],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        monkeypatch.setenv("HOLD_S", str(3 * run.SHM_WATCH_S))
        result = run.run_repro(finding, workdir, None)
        other_pid = int(other.stdout.readline())
        workers = [int(p) for p in (workdir / "made").read_text().split()]
        mine = [n for pid in workers for n in _sem_names(pid)]
        shm_names += mine + [f"sem.hdr{other_pid}-0"]
        assert result.returncode == 1 and result.line.startswith("FAIL"), result
        assert (SHM_DIR / f"sem.hdr{other_pid}-0").exists(), "another process's semaphore was removed"
        assert [n for n in mine if (SHM_DIR / n).exists()] == [], "the repro's semaphores were left in /dev/shm"
        assert sorted(result.shm_removed) == sorted(mine)
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(timeout=10)
