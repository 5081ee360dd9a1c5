"""Each vLLM process's C heap as glibc sees it, written every ``TESTBED_HEAP_PROBE_S`` seconds.

A soak saw the resident memory of vLLM's Ray worker processes grow for as long as it ran
(docs/soak.md). Resident memory alone cannot tell a leak (memory still in use, growing) from an
allocator that keeps what was freed (glibc's heap: freed chunks stay mapped until the top of
an arena is free, and its mmap threshold rises after each large free, so later large buffers
come from the arenas). ``mallinfo2()`` tells the two apart from inside the process: bytes in
use (``uordblks`` + mmapped chunks) against bytes free but kept (``fordblks``).

A process's probe thread writes ``<dir>/<pid>.json`` (atomically: a rename) with those figures
and Python's own count of allocated blocks; ``node/usage.py`` reads the files of the live
processes of its node. What is sent does not change; the cost is one ``mallinfo2`` call per period
and process (it walks the arenas' free chunks under their locks).
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

HEAP_DIR = Path("/tmp/testbed-heap")
MiB = 1024 * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Any:
    libc = ctypes.CDLL(None)
    function = getattr(libc, "mallinfo2", None)  # glibc >= 2.33; none under musl
    if function is None:
        return None
    function.restype = _Mallinfo2
    return function


_MALLINFO2 = _mallinfo2()


class ContextVarCount:
    """How many context variables the fullest ``contextvars.Context`` of this process holds: the
    signature of a known leak (findings/contextvar-per-forward: torch's ``config.patch()`` sets a
    new ``ContextVar`` on every forward pass of vLLM 0.32.0, and the thread's context keeps each).

    Another thread's context cannot be read from this one, but each is an object the garbage
    collector tracks: every ``rescan`` calls (and while none is found) ``gc.get_objects()`` is
    searched for them (a walk over every object the collector tracks) and the ``keep`` fullest are
    held; in between only their lengths are read. The maximum, not the sum: an asyncio task runs
    in a copy of its thread's context, and copies share their variables."""

    def __init__(self, rescan: int = 10, keep: int = 4) -> None:
        self.rescan, self.keep, self.calls = rescan, keep, 0
        self.contexts: list[contextvars.Context] = []

    def __call__(self) -> int:
        if not self.contexts or self.calls % self.rescan == 0:
            found = [o for o in gc.get_objects() if type(o) is contextvars.Context]
            self.contexts = sorted(found, key=len, reverse=True)[:self.keep]
        self.calls += 1
        return max((len(c) for c in self.contexts), default=len(contextvars.copy_context()))


_context_vars = ContextVarCount()


def read() -> dict[str, float]:
    """This process's heap now (MiB): ``heap_in_use_mb`` (allocated and not freed: arenas plus
    mmapped chunks), ``heap_free_mb`` (freed, still held by the arenas), ``heap_mmapped_mb``,
    ``heap_arena_mb`` (what the arenas took from the system); ``python_blocks`` (objects and
    buffers Python's allocator holds), ``context_vars`` (``ContextVarCount``). Without ``mallinfo2``
    (not glibc): no ``heap_*`` figures."""
    figures: dict[str, float] = {"python_blocks": float(sys.getallocatedblocks()), "context_vars": float(_context_vars())}
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        figures.update(heap_in_use_mb=(info.uordblks + info.hblkhd) / MiB, heap_free_mb=info.fordblks / MiB,
                       heap_mmapped_mb=info.hblkhd / MiB, heap_arena_mb=info.arena / MiB)
    return figures


def start_ticks(pid: int | str = "self") -> int:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); 0 if it is gone. With
    the pid it names one process: a node container restarted keeps /tmp, and its pids come again."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def write(role: str, directory: Path = HEAP_DIR, start: int | None = None) -> Path:
    """Write this process's figures to ``directory/<pid>.json`` (a rename: a reader never sees half);
    ``start``: this process's ``start_ticks()``, if already read."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}.json"
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps({"pid": os.getpid(), "start": start or start_ticks(), "role": role, "t": time.time(),
                                       **read()}))
    os.replace(scratch, path)
    return path


def _loop(role: str, every_s: float, directory: Path) -> None:
    start = start_ticks()
    while True:
        try:
            write(role, directory, start)
        except OSError:
            pass  # a full /tmp (a nemesis) costs a sample, never the process
        time.sleep(every_s)


TRACE_PERIOD_S = 300.0  # a snapshot of millions of blocks takes seconds of the process's one core


def _trace_loop(frames: int, directory: Path, period_s: float) -> None:
    """``TESTBED_HEAP_TRACE=N`` (a diagnosis, not a default: it slows every allocation): where Python
    memory is allocated and not freed. A baseline after ``period_s``, then every ``period_s``
    ``<pid>.trace.json``: the allocation sites (N frames) and object types that grew most since."""
    import tracemalloc
    from collections import Counter

    def types() -> Counter[str]:
        return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())

    # This loop's own allocations (its type counts) have this file anywhere in their traceback.
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__, all_frames=True)]
    tracemalloc.start(frames)
    time.sleep(period_s)
    baseline, baseline_types, since = tracemalloc.take_snapshot().filter_traces(ignore), types(), time.time()
    while True:
        time.sleep(period_s)
        try:
            stats = tracemalloc.take_snapshot().filter_traces(ignore).compare_to(baseline, "traceback")
            grown = types() - baseline_types
            report = {"since": since, "t": time.time(), "traced_mb": tracemalloc.get_traced_memory()[0] / MiB,
                      "sites": [{"size_kb": round(st.size_diff / 1024, 1), "count": st.count_diff,
                                 "where": [f"{f.filename}:{f.lineno}" for f in st.traceback]}
                                for st in stats[:15]],
                      "types": grown.most_common(15)}
            scratch = directory / f"{os.getpid()}.trace.tmp"
            scratch.write_text(json.dumps(report, indent=1))
            os.replace(scratch, directory / f"{os.getpid()}.trace.json")
        except OSError:
            pass


_started: set[int] = set()


def prune(directory: Path = HEAP_DIR) -> int:
    """Remove the files of processes that are gone (killed ones leave theirs); return how many."""
    removed = 0
    for path in directory.glob("*.json"):
        if path.name.endswith(".trace.json"):
            if not (directory / f"{path.name.split('.')[0]}.json").exists():
                path.unlink(missing_ok=True)  # its process's own file went: so does its trace
            continue
        try:
            written_by = json.loads(path.read_text()).get("start")
        except (OSError, ValueError):
            continue  # being replaced, or not ours to judge
        if not path.stem.isdigit() or written_by != start_ticks(int(path.stem)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def install(role: str, every_s: float, directory: Path = HEAP_DIR, trace_frames: int = 0,
            trace_period_s: float = TRACE_PERIOD_S) -> bool:
    """Start this process's probe thread (once per process; a forked child starts its own). Its
    file goes at a normal exit; each new probe removes those of processes killed before."""
    if every_s <= 0 or os.getpid() in _started:
        return False
    _started.add(os.getpid())
    prune(directory)
    atexit.register((directory / f"{os.getpid()}.json").unlink, missing_ok=True)
    atexit.register((directory / f"{os.getpid()}.trace.json").unlink, missing_ok=True)
    threading.Thread(target=_loop, args=(role, every_s, directory), daemon=True, name="testbed-heap-probe").start()
    if trace_frames > 0:
        threading.Thread(target=_trace_loop, args=(trace_frames, directory, trace_period_s), daemon=True,
                         name="testbed-heap-trace").start()
    return True


def read_files(pids: list[int], directory: Path = HEAP_DIR) -> dict[int, dict[str, Any]]:
    """The probe files of ``pids`` written by those very processes (a process without a probe, or
    a file left by an earlier process of the same pid: absent)."""
    found = {}
    for pid in pids:
        try:
            figures = json.loads((directory / f"{pid}.json").read_text())
        except (OSError, ValueError):
            continue
        if figures.get("start") == start_ticks(pid):
            found[pid] = figures
    return found
