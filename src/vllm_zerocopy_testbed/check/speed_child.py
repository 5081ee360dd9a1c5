"""One side's benchmark process: a real ``MessageQueue`` writer and its readers, measured on request.

Run under the side's overlay (``python -m vllm_zerocopy_testbed.check.speed_child``), every mode
``upstream`` (vLLM's own ``enqueue``, ``dequeue`` and arena). Commands come one JSON line at a time on
stdin; each answer is one JSON line on the file descriptor ``CHECK_REPLY_FD`` names (vLLM logs to
stdout). The parent stops this process's whole group between its turns, so that the side that is
not measured takes no CPU from the one that is.

  {"op": "open", "topology": "local-1", "timeout": 600}   readers started, warmed: {"ok": true}
  {"op": "measure", "nbytes": N, "count": k, "warm": w, "min_s": s}
                                            {"times": [ms...], "enqueue": [ms...]}: k messages and s seconds at least
  {"op": "detach", "shape": S, "count": k, "min_s": s}    vLLM's detach on fresh outputs: {"times": [ms...]}
  {"op": "exit"}                                           {"maxrss_bytes": n} and the process ends
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
import traceback

import torch

from vllm_zerocopy_testbed.bench.broadcast import host_cpus, threads_on
from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import RECEIVED_AT, MessageQueueHarness, QueueTopology

REPLY_FD_ENV = "CHECK_REPLY_FD"
TOPOLOGIES = {
    "local-1": QueueTopology(local_readers=1),
    "remote-1": QueueTopology(local_readers=0, remote_readers=1),
    # vLLM 0.32's arena (tensors >= 8 MiB into shared slots); every page read at the reader
    "arena-1": QueueTopology(local_readers=1, arena=True),
}
_WARM_S = 0.5


class Bench:
    """The open harness and its tensors."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.harness: MessageQueueHarness | None = None
        self.tensors: dict[int, torch.Tensor] = {}

    def open(self, topology: str, timeout: float) -> dict:
        self.stack.close()
        self.stack = contextlib.ExitStack()
        topo = TOPOLOGIES[topology]
        # Writer and readers on CPUs of their own, local readers too: left to the scheduler, one side's
        # writer and reader shared a core and the other's did not, for the whole run (identical code read
        # 1.8x slower on one side at 64 KiB).
        split = host_cpus()
        writer_cpus, reader_cpus = split if split else (None, None)
        self.stack.enter_context(threads_on(writer_cpus))
        self.harness = self.stack.enter_context(MessageQueueHarness(
            topo, PatchMode.UPSTREAM, timeout=timeout, arena_mode=PatchMode.UPSTREAM, ack_only=True,
            remote_reader_cpus=reader_cpus, touch=topo.arena))
        if reader_cpus is not None:
            for pid in self.harness.reader_pids:
                _pin_process(pid, reader_cpus)
        small, until = torch.randn(16 * 1024), time.monotonic() + _WARM_S
        while time.monotonic() < until:  # fresh readers are slow for their first messages
            self.harness.send({"prompt_embeds": small})
            self.harness.collect()
        return {"ok": True}

    def measure(self, nbytes: int, count: int, warm: int, min_s: float = 0.0, most: int = 200) -> dict:
        """``warm`` messages, then at least ``count`` and ``min_s`` seconds of them (``most`` at most)."""
        if self.harness is None:
            raise RuntimeError("measure before open")
        tensor = self.tensors.setdefault(nbytes, torch.randn(nbytes // 4))
        times, held = [], []
        until = None
        for i in range(warm + most):
            if i == warm:
                until = time.monotonic() + min_s
            if i >= warm + count and time.monotonic() >= until:
                break
            start = time.perf_counter()
            self.harness.send({"prompt_embeds": tensor})
            sent = time.perf_counter()
            received = max(report[RECEIVED_AT] for report in self.harness.collect().values())
            if i >= warm:
                times.append((received - start) * 1e3)
                held.append((sent - start) * 1e3)
        return {"times": times, "enqueue": held}


class Detach:
    """vLLM's own detach (``upstream``) on fresh channel-like outputs of one shape (``bench/detach.py``'s)."""

    def __init__(self) -> None:
        self.outputs: dict[str, object] = {}

    def measure(self, shape: str, count: int, min_s: float, most: int = 400) -> dict:
        from vllm_zerocopy_testbed.bench.detach import NUM_REQS, _Outputs
        from vllm_zerocopy_testbed.patches.detach import resolve

        function = resolve(PatchMode.UPSTREAM)
        outputs = self.outputs.setdefault(shape, _Outputs(shape, NUM_REQS))
        times = []
        until = time.monotonic() + min_s
        while len(times) < most and (len(times) < count or time.monotonic() < until):
            output = outputs.fresh()  # built before the clock starts
            start = time.perf_counter()
            function(output)
            times.append((time.perf_counter() - start) * 1e3)
        return {"times": times, "enqueue": times}


def _pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (ZMQ's I/O threads included)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            os.sched_setaffinity(int(tid), cpus)


def main() -> int:
    reply = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w", buffering=1)
    torch.set_num_threads(1)  # the writer copies on one thread, as the bench's memcpy floor does
    bench, detach = Bench(), Detach()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["op"] == "open":
                    answer = bench.open(cmd["topology"], float(cmd.get("timeout", 600)))
                elif cmd["op"] == "measure":
                    answer = bench.measure(int(cmd["nbytes"]), int(cmd["count"]), int(cmd.get("warm", 1)),
                                           float(cmd.get("min_s", 0.0)))
                elif cmd["op"] == "detach":
                    answer = detach.measure(cmd["shape"], int(cmd["count"]), float(cmd.get("min_s", 0.0)))
                elif cmd["op"] == "exit":
                    break
                else:
                    answer = {"error": f"unknown op {cmd['op']!r}"}
            except Exception as exc:  # the parent says which side and cell failed
                answer = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            reply.write(json.dumps(answer) + "\n")
    finally:
        bench.stack.close()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    readers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    reply.write(json.dumps({"maxrss_bytes": max(own, readers) * 1024}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
