"""What one node holds right now: its processes' memory and file descriptors, its /dev/shm, its
share of Ray's object store. ``make soak`` samples this every minute per node and fits a
growth rate to each figure (a slow leak is a slope, not a level).

Run inside a node (``python -m vllm_zerocopy_testbed.node.usage --gcs HEAD:6379 --node-ip IP``,
what the compose backend does through ``docker exec``): one JSON object on stdout. The local
backend calls the functions for its own process sessions.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable

from vllm_zerocopy_testbed.observe import heap as heap_probe

MiB = 1024 * 1024


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0  # gone meanwhile, or a kernel thread


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def all_pids(exclude: Iterable[int] = ()) -> list[int]:
    """Every process this PID namespace shows (a container: the node), but ``exclude``."""
    skip = set(exclude)
    return sorted(int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in skip)


def processes(pids: Iterable[int]) -> dict[str, float]:
    """Resident memory (the sum of VmRSS: pages shared by several processes count in each) and
    open file descriptors of ``pids``."""
    pids = list(pids)
    return {"rss_mb": sum(_rss_bytes(p) for p in pids) / MiB, "fds": float(sum(_fds(p) for p in pids)),
            "processes": float(len(pids))}


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    # Ray renames its workers (ray::RayWorkerProc.run); else the program and its module, if any
    if first.startswith(("ray::", "VLLM::")) or len(argv) < 3:
        return first.rsplit("/", 1)[-1][:48]
    module = argv[2].decode(errors="replace") if argv[1] == b"-m" else argv[1].decode(errors="replace")
    return f"{first.rsplit('/', 1)[-1]} {module.rsplit('/', 1)[-1]}"[:48]


def by_process(pids: Iterable[int], top: int = 8, min_mb: float = 50.0) -> dict[str, float]:
    """The ``top`` largest processes' resident memory, as ``rss_mb/<name>[<pid>]`` keys: which
    process a growth of the node's sum is in (a slow leak names itself)."""
    return {f"rss_mb/{_name(pid)}[{pid}]": _rss_bytes(pid) / MiB for pid in largest(pids, top, min_mb)}


HEAP_FIGURES = ("heap_in_use_mb", "heap_free_mb")


def heap(pids: Iterable[int], named: Iterable[int] = (), directory: Path = heap_probe.HEAP_DIR) -> dict[str, float]:
    """The C heap of the processes among ``pids`` that run the heap probe (vLLM's, ``observe/heap.py``):
    node sums of bytes in use, of bytes freed but kept, of Python blocks and of context variables
    (the known leak's signature, ``heap.ContextVarCount``), and per process of ``named`` (the
    largest, from ``by_process``) as ``heap_in_use_mb/<name>[<pid>]``. Empty without probes.
    RSS growing with ``heap_in_use_mb`` flat is the allocator keeping memory, not a leak."""
    files = heap_probe.read_files(list(pids), directory)
    if not files:
        return {}
    figures = {f: sum(v.get(f, 0.0) for v in files.values()) for f in HEAP_FIGURES}
    figures["heap_processes"] = float(len(files))
    figures["python_blocks"] = sum(v.get("python_blocks", 0.0) for v in files.values())
    figures["context_vars"] = sum(v.get("context_vars", 0.0) for v in files.values())
    for pid in named:
        if pid in files:
            figures.update({f"{f}/{_name(pid)}[{pid}]": files[pid].get(f, 0.0) for f in (*HEAP_FIGURES, "context_vars")
                            if f in files[pid]})
    return figures


ONEDNN_MISS = b"create:cache_miss"
ONEDNN_CAPACITY = 1024  # oneDNN's default ONEDNN_PRIMITIVE_CACHE_CAPACITY


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        words = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(w.split(b"=", 1) for w in words if b"=" in w)


def onednn_cached(pids: Iterable[int]) -> dict[str, float]:
    """How many primitives oneDNN's cache holds in each process that logs their creation
    (``ONEDNN_VERBOSE=profile_create``, which ``make soak`` sets on the nodes it brings up): the
    ``create:cache_miss`` lines in the file its stdout goes to (a Ray worker's ``.out`` log),
    capped at the cache's capacity (the process's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, else 1024:
    past it, a new primitive replaces one). The node sum as ``onednn_cached``; empty when no
    process logs them. The signature of a bounded cache that a mixed stream fills slowly
    (docs/soak.md, "What grows in the first hour")."""
    total, seen = 0, False
    for pid in pids:
        env = _environ(pid)
        if b"profile_create" not in env.get(b"ONEDNN_VERBOSE", b""):
            continue
        try:
            out = os.readlink(f"/proc/{pid}/fd/1")
            with open(out, "rb") as stream:
                misses = sum(line.count(ONEDNN_MISS) for line in stream)
        except (OSError, ValueError):
            continue  # gone, or its stdout is not a file
        try:
            capacity = int(env.get(b"ONEDNN_PRIMITIVE_CACHE_CAPACITY", b"") or ONEDNN_CAPACITY)
        except ValueError:
            capacity = ONEDNN_CAPACITY
        total, seen = total + min(misses, capacity), True
    return {"onednn_cached": float(total)} if seen else {}


def largest(pids: Iterable[int], top: int = 8, min_mb: float = 50.0) -> list[int]:
    """The ``top`` processes with the most resident memory, at least ``min_mb`` each."""
    sizes = sorted(((_rss_bytes(p) / MiB, p) for p in pids), reverse=True)[:top]
    return [pid for mb, pid in sizes if mb >= min_mb]


def shm(path: str | Path = "/dev/shm") -> dict[str, float]:
    """Bytes allocated in ``path`` (blocks, not apparent sizes: a sparse ring counts what it
    touched) and the number of files there."""
    allocated, files = 0, 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                allocated += os.lstat(os.path.join(root, name)).st_blocks * 512
                files += 1
            except OSError:
                continue  # removed meanwhile
    return {"shm_mb": allocated / MiB, "shm_files": float(files)}


def object_store(gcs_address: str, node_ip: str) -> dict[str, float]:
    """This node's Ray object store use, from its raylet (found in the GCS node table); no driver
    is started. Empty where the GCS or the raylet does not answer."""
    try:
        from ray._private.internal_api import node_stats
        from ray._raylet import GcsClient

        nodes = GcsClient(address=gcs_address).get_all_node_info(timeout=10)
        for info in nodes.values():
            if info.state == 0 and info.node_manager_address == node_ip:  # 0: ALIVE
                stats = node_stats(info.node_manager_address, info.node_manager_port, include_memory_info=False)
                return {"object_store_mb": stats.store_stats.object_store_bytes_used / MiB,
                        "object_store_objects": float(stats.store_stats.num_local_objects)}
    except Exception:  # Ray's errors are many kinds: a sample without it is still a sample
        pass
    return {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gcs", default=None, help="the Ray GCS address (HEAD:6379); omit for no object store figure")
    parser.add_argument("--node-ip", default=None, help="this node's Ray address")
    args = parser.parse_args(argv)
    pids = all_pids(exclude=(os.getpid(),))
    figures = {**processes(pids), **by_process(pids), **heap(pids, largest(pids)), **onednn_cached(pids), **shm()}
    if args.gcs and args.node_ip:
        figures.update(object_store(args.gcs, args.node_ip))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
