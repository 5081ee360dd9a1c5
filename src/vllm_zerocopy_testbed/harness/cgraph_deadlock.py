"""Pure-Ray reproduction: a cross-node compiled graph deadlocks on zero-copy outputs
(findings/cgraph-raylet-writeacquire).

Standalone (needs only ``ray`` and ``numpy``): ``python cgraph_deadlock.py [--inband]``.

Shape of vLLM's compiled graph with PP=2 x TP=2: the driver reads one output
channel per last-stage TP rank, the ranks live on another node, and two
executions are in flight (vLLM's batch queue fills the pipeline). Here: two
actors on node B, the driver on node A, ``MultiOutputNode`` of both, and two
``execute`` calls before the first ``get``.

What happens (Ray 2.60): the driver reads execution N's output of rank 0 —
a numpy array, deserialized zero-copy from the channel buffer, so the buffer
stays acquired while the array lives — and waits for rank 1's output of N.
Rank 0's output of N+1 reaches the driver's raylet first (rank 1 is slower, as
after vLLM's first-use compile of the logprobs op). The raylet applies remote
writes on its main thread (``NodeManager::HandlePushMutableObject`` ->
``MutableObjectProvider::HandlePushMutableObject`` -> ``WriteAcquire``, no
timeout), so it blocks until the driver releases rank 0's buffer of N — which
the driver does only after reading rank 1's output of N, whose push waits
behind the blocked one. A circular wait: the get times out
(``RayChannelTimeoutError``) and nothing ever moves again.

``--inflight vllm``: as many executions in flight as vLLM's engine would keep for a
compiled-graph PP=2 x TP=2 cluster in this process's modes: vLLM's general plugins are
loaded as in an engine-core process (the testbed's caps it at one with
``TESTBED_DETACH=testbed``, ``patches/inflight.py``), then ``max_concurrent_batches``
is read from a ``VllmConfig`` of that shape. Needs vLLM; the rest does not.

``--inband``: the actors return arrays that pickle in band (one copy into the
pickle stream, rebuilt as an ordinary writable array): nothing keeps the
channel buffer acquired after deserialization, and the same schedule passes.
Exit status: 0 if every get answered, 1 on the deadlock.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from vllm_zerocopy_testbed.config import VLLM_V2_EXECUTOR_ENV, set_process_env

DRIVER_IP, RANK_IP = "127.0.0.2", "127.0.0.3"


def _rebuild(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


class InBandArray(np.ndarray):
    """An ndarray view that pickles its bytes in band (no out-of-band ``PickleBuffer``)."""

    def __reduce_ex__(self, protocol: int):
        array = np.ascontiguousarray(self)
        return _rebuild, (array.tobytes(), array.dtype.str, array.shape)


WARMUP_TIMEOUT_S = 120.0


def start_cluster() -> Any:
    """Two loopback Ray nodes (Ray rewrites 127.0.0.1 to the host's address): the driver's
    (resource ``driver_node``) and the ranks' (``rank_node``); a ``ray.cluster_utils.Cluster``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"driver_node": 1}, "node_ip_address": DRIVER_IP})
    cluster.add_node(num_cpus=2, resources={"rank_node": 2}, node_ip_address=RANK_IP)
    cluster.wait_for_nodes()
    return cluster


def run(*, inband: bool, inflight: int = 2, steps: int = 6, slow_s: float = 1.0, timeout_s: float = 20.0,
        address: str | None = None) -> tuple[bool, str]:
    """Run the schedule; return (every get answered, what happened)."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    cluster = start_cluster() if address is None else None  # lives as long as this process
    ray.init(address=address if cluster is None else cluster.address, logging_level="ERROR", _node_ip_address=DRIVER_IP)

    @ray.remote(num_cpus=0, resources={"rank_node": 1})
    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def step(self, index: int):
            if self.rank == 1 and index == 1:
                time.sleep(slow_s)  # rank 1 lags one step (vLLM: its first logprobs compile)
            output = np.full(4096, index, dtype=np.float32)  # logprobs-like: out of band when pickled
            return output.view(InBandArray) if inband else output

    ranks = [Rank.remote(0), Rank.remote(1)]
    with InputNode() as inp:
        dag = MultiOutputNode([r.step.bind(inp) for r in ranks])
    compiled = dag.experimental_compile()
    # One execution alone first, read whole, under a start-up bound: the actors' first call
    # (imports, channel set-up) must not count against the get timeout the schedule is about
    # (a busy machine took over 10 s there and an in-band run read as a deadlock).
    for ref in compiled.execute(-1):
        ref.get(timeout=max(timeout_s, WARMUP_TIMEOUT_S))
    # A graph stuck in the raylet does not tear down: the caller ends the process (os._exit);
    # the Cluster's Ray processes share its fate.
    pending = [compiled.execute(i) for i in range(inflight - 1)]
    for index in range(steps):
        pending.append(compiled.execute(index + inflight - 1))  # `inflight` executions in flight
        refs = pending.pop(0)
        try:
            first = refs[0].get(timeout=timeout_s)  # keeps rank 0's buffer acquired ...
            second = refs[1].get(timeout=timeout_s)  # ... while rank 1's output is read
        except Exception as exc:  # RayChannelTimeoutError
            return False, f"execution {index}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        if first[0] != index or second[0] != index:
            return False, f"execution {index}: wrong values {first[0]}, {second[0]}"
        del first, second
    for refs in pending:
        for ref in refs:
            ref.get(timeout=timeout_s)
    return True, f"{steps + inflight - 1} executions answered"


def vllm_inflight(pp: int = 2, tp: int = 2) -> int:
    """Return the executions vLLM's engine keeps in flight on a compiled-graph PP x TP Ray cluster,
    with the general plugins loaded as vLLM loads them in its engine-core process."""
    import multiprocessing

    set_process_env(VLLM_V2_EXECUTOR_ENV, "0")  # the compiled-graph executor
    multiprocessing.current_process().name = "EngineCore_DP0"  # the role plugins act on
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return compiled_graph_inflight(pp, tp)


def compiled_graph_inflight(pp: int = 2, tp: int = 2) -> int:
    """``max_concurrent_batches`` of a compiled-graph PP x TP Ray ``VllmConfig``, in this process's modes."""
    from vllm.config import ParallelConfig, VllmConfig

    set_process_env(VLLM_V2_EXECUTOR_ENV, "0")
    return VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                                     distributed_executor_backend="ray")).max_concurrent_batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inband", action="store_true", help="return arrays that pickle in band")
    parser.add_argument("--inflight", default="2",
                        help="executions in flight (vLLM: PP size), or `vllm`: what vLLM's engine would keep")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--address", default=None, help="an existing 2-node cluster (resources driver_node, rank_node)")
    args = parser.parse_args(argv)
    address = args.address
    if args.inflight == "vllm":
        # vLLM's import (~6 s, on one core) while the cluster's Ray processes start (on the
        # other); Ray's Cluster sets signal handlers, so it starts on the main thread.
        with ThreadPoolExecutor(1) as pool:
            counting = pool.submit(vllm_inflight)
            cluster = start_cluster() if address is None else None
            inflight = counting.result()
        address = address if cluster is None else cluster.address
        print(f"in flight: {inflight} (vLLM's max_concurrent_batches, compiled graph, PP=2 x TP=2)", flush=True)
    elif args.inflight.isdigit() and int(args.inflight) >= 1:
        inflight = int(args.inflight)
    else:
        parser.error(f"--inflight must be a positive integer or `vllm`, got {args.inflight!r}")
    ok, what = run(inband=args.inband, inflight=inflight, timeout_s=args.timeout, address=address)
    print(("PASS: " if ok else "DEADLOCK: ") + what, flush=True)
    import os

    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
