"""A run removes from /dev/shm only what its own processes made (two runs may share one machine).

Real processes and real POSIX shared memory: each "run" starts a process with its claim's token that
creates a segment and dies by SIGKILL (as vLLM's do on a stop), while a process of no claim (another
run) makes one beside them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.cluster.shm import SHM_DIR, ShmClaim

pytestmark = pytest.mark.unit

# Creates a segment (in a grandchild with GRANDCHILD=1: a worker the server spawned), says its name,
# holds it until killed; with EXIT_AFTER=S it exits after S seconds without unlinking (a crash).
MAKER = r"""
import os, subprocess, sys, time
from multiprocessing import resource_tracker, shared_memory
if os.environ.get("GRANDCHILD") == "1":
    env = {**os.environ, "GRANDCHILD": "0"}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[1]], env=env)
    child.wait()
    sys.exit(0)
segment = shared_memory.SharedMemory(name=os.environ["NAME"], create=True, size=4096)
resource_tracker.unregister(segment._name, "shared_memory")  # a killed vLLM process unlinks nothing
print(segment.name, flush=True)
time.sleep(float(os.environ.get("EXIT_AFTER", "60")))
os._exit(0)
"""


def _name(tag: str) -> str:
    return f"psm_testbed_{tag}_{uuid.uuid4().hex[:8]}"


def _start(name: str, env: dict[str, str] | None = None, **extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKER, MAKER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {}), "NAME": name, **extra}, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (SHM_DIR / name).exists():
        assert proc.poll() is None or (SHM_DIR / name).exists(), f"the maker of {name} exited ({proc.returncode})"
        assert time.monotonic() < deadline, f"{name} not made within 30 s"
        time.sleep(0.02)
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_each_run_removes_its_own_segments_and_nothing_else(shm_names) -> None:
    a, b = ShmClaim.take(), ShmClaim.take()
    shm_names += [_name("a"), _name("b"), _name("other")]
    procs = [_start(shm_names[0], a.env, GRANDCHILD="1"), _start(shm_names[1], b.env),
             _start(shm_names[2])]  # another run's, made after both claims, held by nobody of ours
    try:
        assert shm_names[0] in a.record() and shm_names[1] in b.record()
        assert a.seen == {shm_names[0]} and b.seen == {shm_names[1]}
    finally:
        for proc in procs:
            _kill(proc)
    assert a.remove_new() == [shm_names[0]]
    assert not (SHM_DIR / shm_names[0]).exists()
    assert (SHM_DIR / shm_names[1]).exists() and (SHM_DIR / shm_names[2]).exists(), "run a removed another run's file"
    assert b.remove_new() == [shm_names[1]] and (SHM_DIR / shm_names[2]).exists()
    assert not a.paths() and not b.paths()


def test_the_watch_records_a_process_that_died_before_the_stop(shm_names) -> None:
    claim = ShmClaim.take()
    shm_names.append(_name("crash"))
    claim.watch(interval=0.1)
    proc = _start(shm_names[0], claim.env, EXIT_AFTER="1")
    proc.wait(timeout=30)  # gone, its segment left behind
    assert claim.paths() == [str(SHM_DIR / shm_names[0])]
    assert claim.remove_new() == [shm_names[0]] and not (SHM_DIR / shm_names[0]).exists()


def test_what_was_there_before_the_claim_is_never_ours(shm_names) -> None:
    shm_names.append(_name("before"))
    proc = _start(shm_names[0])
    try:
        claim = ShmClaim.take()
        assert not claim.record([proc.pid]), "an entry older than the claim was taken for ours"
    finally:
        _kill(proc)
    assert claim.remove_new() == [] and (SHM_DIR / shm_names[0]).exists()


def test_an_api_server_process_owns_its_temp_directory_and_segments(shm_names, tmp_path) -> None:
    """``ApiServerProcess``: its processes get the token and a temp directory of their own (vLLM's
    ``vllm_dist_*`` file store goes there), both gone after ``stop``; another's file stays."""
    from vllm_zerocopy_testbed.cluster.api_server import ApiServerProcess

    shm_names += [_name("server"), _name("beside")]
    server = ApiServerProcess("test server", "testbed-test-server-")
    script = MAKER.replace("print(segment.name", "open(os.path.join(os.environ['TMPDIR'], 'vllm_dist_x'), 'w')\n"
                                                 "print(segment.name")
    server.start([sys.executable, "-c", script, script], {**os.environ, "NAME": shm_names[0]})
    beside = _start(shm_names[1])
    try:
        assert server.tmp is not None
        store = Path(server.tmp, "vllm_dist_x")
        deadline = time.monotonic() + 30
        while not (store.exists() and (SHM_DIR / shm_names[0]).exists()):
            assert time.monotonic() < deadline and server.running(), server.logs(20)
            time.sleep(0.02)
        server.stop()
    finally:
        _kill(beside)
    assert not (SHM_DIR / shm_names[0]).exists() and (SHM_DIR / shm_names[1]).exists()
    assert server.leftover() == []
    server.log.unlink(missing_ok=True)


# Makes a file named as Ray's channel semaphores are (its own PID in it), maps nothing, then waits.
NAMED = r"""
import os, sys, time
path = f"/dev/shm/sem.hdr{os.getpid()}-{sys.argv[1]}"
open(path, "wb").close()
print(path, flush=True)
time.sleep(60)
"""


def test_a_channel_semaphore_named_after_one_of_our_processes_is_ours(shm_names) -> None:
    """Ray's compiled-graph channels leave ``sem.hdr<pid>-<n>`` unmapped: ours when <pid> was ours."""
    claim = ShmClaim.take()
    tag = uuid.uuid4().hex[:8]
    procs = [subprocess.Popen([sys.executable, "-c", NAMED, tag], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **env}, start_new_session=True) for env in (claim.env, {})]
    try:
        paths = [Path(p.stdout.readline().strip()) for p in procs]  # type: ignore[union-attr]
        shm_names += [p.name for p in paths]
        assert not claim.record(), "nothing of ours is mapped"
    finally:
        for proc in procs:
            _kill(proc)
    assert claim.remove_new() == [paths[0].name]
    assert not paths[0].exists() and paths[1].exists(), "another run's semaphore was taken for ours"
