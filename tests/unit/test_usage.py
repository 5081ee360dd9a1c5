"""A node's figures as the soak samples them: real processes, a real tmpfs-like directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_zerocopy_testbed.node import usage

pytestmark = pytest.mark.unit


def test_processes_add_up_memory_and_descriptors_of_the_pids_given() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); sys.stdout.write('x');"
                              " sys.stdout.flush(); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.read(1) == b"x"
        alone, both = usage.processes([os.getpid()]), usage.processes([os.getpid(), child.pid])
        assert both["processes"] == 2 and both["fds"] > alone["fds"]
        assert both["rss_mb"] - alone["rss_mb"] >= 64, "the child's 64 MiB are resident"
        assert usage.processes([2 ** 22 + 7])["rss_mb"] == 0, "a PID that is gone counts nothing"
        largest = usage.by_process([os.getpid(), child.pid], top=2)
        (key,) = [k for k in largest if k.endswith(f"[{child.pid}]")]
        assert key.startswith("rss_mb/python") and largest[key] >= 64, largest
    finally:
        child.kill()
        child.wait(10)


def test_shm_counts_allocated_bytes_and_files(tmp_path) -> None:
    (tmp_path / "ring").write_bytes(b"\1" * (3 << 20))
    with open(tmp_path / "sparse", "wb") as sparse:
        sparse.truncate(64 << 20)  # a sparse file allocates nothing until written
    figures = usage.shm(tmp_path)
    assert figures["shm_files"] == 2 and 3 <= figures["shm_mb"] < 4


def test_all_pids_leaves_out_what_it_is_told() -> None:
    assert os.getpid() in usage.all_pids() and os.getpid() not in usage.all_pids(exclude=[os.getpid()])
