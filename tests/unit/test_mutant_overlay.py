"""The scratch overlay ``make mutants`` runs tests against: changed sources in every process, nothing touched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_zerocopy_testbed.mutants import catalog, overlay

pytestmark = pytest.mark.unit

LIMIT = overlay.Replacement("vllm_zerocopy_testbed.patches.broadcast", "OOB_MIN_BYTES = 1 << 20",
                            "OOB_MIN_BYTES = 1 << 10")
# The child imports the module, then spawns a grandchild that does too (as harness readers do).
PROBE = """
import multiprocessing as mp
from vllm_zerocopy_testbed.patches import broadcast

def grandchild(q):
    from vllm_zerocopy_testbed.patches import broadcast
    q.put(broadcast.OOB_MIN_BYTES)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=grandchild, args=(q,))
    p.start()
    print(broadcast.OOB_MIN_BYTES, q.get(timeout=60))
    p.join(timeout=30)
"""


def _probe(tmp_path, pythonpath: str | None) -> str:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_the_changed_source_runs_in_the_process_and_its_children_and_each_load_is_logged(tmp_path) -> None:
    source = overlay.module_source(LIMIT.module)
    before = source.read_text()
    folder = overlay.build(tmp_path / "overlay", [LIMIT])
    assert _probe(tmp_path, str(folder)) == "1024 1024"
    assert overlay.loads(folder) == {LIMIT.module: 2}
    assert source.read_text() == before, "the installed source must never change"
    assert _probe(tmp_path, None) == f"{1 << 20} {1 << 20}", "without the overlay the source is as installed"


def test_a_change_that_no_longer_applies_is_an_error_naming_the_module(tmp_path) -> None:
    moved = overlay.Replacement(LIMIT.module, "OOB_MIN_BYTES = 1 << 21", "OOB_MIN_BYTES = 1")
    with pytest.raises(overlay.OverlayError, match="occurs 0 times"):
        overlay.build(tmp_path / "o", [moved])
    twice = overlay.Replacement(LIMIT.module, "OOB_MIN_BYTES", "X")
    with pytest.raises(overlay.OverlayError, match="times, not once"):
        overlay.build(tmp_path / "o", [twice])


def test_a_change_that_breaks_the_syntax_is_an_error(tmp_path) -> None:
    broken = overlay.Replacement(LIMIT.module, "OOB_MIN_BYTES = 1 << 20", "OOB_MIN_BYTES = (")
    with pytest.raises(overlay.OverlayError, match="does not compile"):
        overlay.build(tmp_path / "o", [broken])


def test_every_mutant_applies_to_the_installed_sources_and_names_existing_tests(tmp_path) -> None:
    """The catalog stays true to the installed vLLM and this checkout (a moved line is caught here)."""
    from vllm_zerocopy_testbed.config import REPO_ROOT

    assert len(catalog.MUTANTS) >= 15 and len({m.name for m in catalog.MUTANTS}) == len(catalog.MUTANTS)
    for mutant in catalog.MUTANTS:
        overlay.build(tmp_path / mutant.name, list(mutant.changes))
        for test in mutant.tests:
            assert (REPO_ROOT / test.split("::")[0]).exists(), f"{mutant.name}: no {test}"
    with pytest.raises(ValueError, match="unknown mutants"):
        catalog.by_name(["no-such-mutant"])


def test_a_killed_runs_shared_memory_is_found_and_a_live_processs_is_left_alone(tmp_path) -> None:
    """A mutant run that times out is SIGKILLed with its readers: nothing unlinks their ring. What appeared
    during the run and no live process maps or holds open is the run's leftover; the rest is not ours."""
    from vllm_zerocopy_testbed.mutants import run

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "before").write_bytes(b"x")
    before = frozenset(p.name for p in shm.iterdir())
    (shm / "orphan").write_bytes(b"x")
    mapped, opened = shm / "mapped", shm / "opened"
    mapped.write_bytes(b"\0" * 4096)
    opened.write_bytes(b"x")
    holder = subprocess.Popen(
        # mapped through libc, its descriptor closed (Python's mmap would keep a duplicate open)
        [sys.executable, "-c", "import ctypes, os, time\n"
         "libc = ctypes.CDLL(None); libc.mmap.restype = ctypes.c_void_p\n"
         "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, "
         "ctypes.c_long]\n"
         f"fd = os.open({str(mapped)!r}, os.O_RDWR); assert libc.mmap(None, 4096, 3, 1, fd, 0) not in (None, -1)\n"
         "os.close(fd)\n"
         f"g = open({str(opened)!r}, 'rb')\n"
         "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert run.orphaned_shm(before, shm) == [shm / "orphan"]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in run.orphaned_shm(before, shm)) == ["mapped", "opened", "orphan"]
