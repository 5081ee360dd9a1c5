"""The heap probe over real glibc: what a process has in use against what it freed but glibc kept."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from vllm_zerocopy_testbed.node import usage
from vllm_zerocopy_testbed.observe import heap

pytestmark = pytest.mark.unit

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]


def test_memory_in_use_and_memory_freed_but_kept_are_told_apart() -> None:
    before = heap.read()
    # Small chunks from the arenas (below the mmap threshold): freed, they stay with glibc
    # as long as a live chunk above them pins the top of the heap.
    chunks = [libc.malloc(64 * 1024) for _ in range(512)]  # 32 MiB
    pin = libc.malloc(64 * 1024)
    in_use = heap.read()
    for chunk in chunks:
        libc.free(chunk)
    freed = heap.read()
    libc.free(pin)
    assert in_use["heap_in_use_mb"] - before["heap_in_use_mb"] >= 32
    assert freed["heap_in_use_mb"] - before["heap_in_use_mb"] < 4, "freed memory is not in use"
    assert freed["heap_free_mb"] - in_use["heap_free_mb"] >= 30, "glibc keeps what sits below a live chunk"
    assert freed["python_blocks"] > 0


def test_a_probe_file_counts_only_for_the_process_that_wrote_it(tmp_path) -> None:
    path = heap.write("test", tmp_path)
    assert set(heap.read_files([os.getpid()], tmp_path)) == {os.getpid()}
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "start": data["start"] - 1}))  # an earlier process of this pid
    assert heap.read_files([os.getpid()], tmp_path) == {}
    assert heap.prune(tmp_path) == 1 and not path.exists()


def test_a_node_sums_its_probed_processes_and_names_the_largest(tmp_path) -> None:
    code = ("import sys, time; from pathlib import Path; from vllm_zerocopy_testbed.observe import heap; "
            "b = bytearray(80 << 20); heap.install('ray-worker', 0.2, Path(sys.argv[1])); "
            "sys.stdout.write('x'); sys.stdout.flush(); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.read(1) == b"x"
        figures = {}
        for _ in range(50):  # the probe's first file is written by its thread
            figures = usage.heap([child.pid, os.getpid()], [child.pid], tmp_path)
            if figures:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert figures["heap_processes"] == 1, "only the child runs a probe"
        assert figures["heap_in_use_mb"] >= 80, figures
        (key,) = [k for k in figures if k.startswith("heap_in_use_mb/")]
        assert key.endswith(f"[{child.pid}]") and figures[key] == figures["heap_in_use_mb"]
    finally:
        child.terminate()
        child.wait(10)
    assert not (tmp_path / f"{child.pid}.json").exists() or heap.prune(tmp_path) == 1, "a file outlives no process"


def test_no_probe_no_heap_figures(tmp_path) -> None:
    assert usage.heap([os.getpid()], [os.getpid()], tmp_path) == {}
    assert heap.install("x", 0, tmp_path) is False, "0 s: no probe"
