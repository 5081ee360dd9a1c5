"""Real vLLM outputs through a real Ray compiled graph, read by vLLM's executor.

Actors (pinned to a node by a custom resource), one per worker of the last pipeline
stage, return a ``ModelRunnerOutput`` whose logprobs are numpy arrays. The driver
reads each step through vLLM's own ``RayDistributedExecutor._execute_dag`` — the
engine's read (``non_block=True``: a ``FutureWrapper``, whose ``result`` detaches) on
even steps, the blocking read (which detaches itself) on odd ones — and keeps every
output alive, as the scheduler keeps a request's logprobs. Without a detach the
second read stalls until its bound.

Only rank 0's output reaches the scheduler. With a KV connector every worker's output
is read and detached before vLLM's ``KVOutputAggregator`` merges them into rank 0's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.patches import detach

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputShape:
    """What a step's output carries, each field with the type vLLM 0.32 gives it."""

    num_reqs: int = 4
    num_logprobs: int = 5
    # > 0: prompt logprobs of this many rows per request, as vLLM's torch ``LogprobsTensors``
    prompt_len: int = 0
    # True: a numpy ``SamplingMaskLists`` (``return_sampling_mask``), which upstream's detach skips
    sampling_mask: bool = False


def make_output(step: int, shape: OutputShape) -> Any:
    """Return a ``ModelRunnerOutput`` of ``shape`` with deterministic contents."""
    import torch
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput

    rng = np.random.default_rng(step)
    rows, cols = shape.num_reqs, shape.num_logprobs + 1
    req_ids = [f"req-{i}" for i in range(shape.num_reqs)]
    logprobs = LogprobsLists(
        logprob_token_ids=rng.integers(0, 512, size=(rows, cols), dtype=np.int32),
        logprobs=rng.standard_normal((rows, cols)).astype(np.float32),
        sampled_token_ranks=rng.integers(0, cols, size=rows, dtype=np.int32),
    )
    prompt: dict[str, Any] = {}
    for req in req_ids if shape.prompt_len else ():
        prompt[req] = LogprobsTensors(
            logprob_token_ids=torch.from_numpy(rng.integers(0, 512, size=(shape.prompt_len, cols))),
            logprobs=torch.from_numpy(rng.standard_normal((shape.prompt_len, cols)).astype(np.float32)),
            selected_token_ranks=torch.from_numpy(rng.integers(0, cols, size=shape.prompt_len)),
        )
    extra: dict[str, Any] = {}
    if shape.sampling_mask:  # vLLM >= 0.28 only (has_sampling_masks())
        from vllm.v1.outputs import SamplingMaskLists

        kept = rng.integers(0, 512, size=rows * 8, dtype=np.int32)
        extra["sampling_masks"] = SamplingMaskLists(token_ids=kept,
                                                    offsets=np.arange(0, rows * 8 + 1, 8, dtype=np.int64))
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[step] for _ in req_ids],
        logprobs=logprobs,
        prompt_logprobs_dict=prompt,
        **extra,
    )


def has_sampling_masks() -> bool:
    """Whether the installed vLLM's ``ModelRunnerOutput`` carries ``sampling_masks``."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    return any(f.name == "sampling_masks" for f in dataclasses.fields(ModelRunnerOutput))


@dataclass
class StepRecord:
    """One step of the history: how long the read took and how it ended."""

    step: int
    seconds: float
    error: str | None = None


@dataclass
class ChannelHistory:
    """Every step the driver attempted, in order."""

    mode: PatchMode
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def first_error(self) -> StepRecord | None:
        return next((s for s in self.steps if s.error is not None), None)


def _producer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class OutputProducer:
        def __init__(self, shape: OutputShape) -> None:
            import importlib

            importlib.import_module("vllm.v1.outputs")  # import cost off the first step

            self.shape = shape

        def execute_model(self, inputs: tuple[int, None], rank: int, kv_connector: bool) -> Any:
            """This worker's output of step ``inputs[0]`` (the executor sends (scheduler output,
            grammar output)): tokens marked by ``rank`` (rank 0's are the ones the scheduler gets);
            with a KV connector, one request's KV sends finished on this worker."""
            from vllm.v1.outputs import KVConnectorOutput

            step = inputs[0]
            output = make_output(step, self.shape)
            output.sampled_token_ids = [[step + 1000 * rank] for _ in output.req_ids]
            if kv_connector:
                output.kv_connector_output = KVConnectorOutput(finished_sending={_finished_req(step)})
            return output

    return OutputProducer


def _finished_req(step: int) -> str:
    return f"req-{step}"  # a request id of its own per step: the aggregator counts each one afresh


def run_compiled_graph(
    mode: PatchMode,
    steps: int,
    shape: OutputShape = OutputShape(),
    node_resource: str | None = None,
    first_timeout: float = 120.0,
    step_timeout: float = 5.0,
    workers: int = 1,
    kv_connector: bool = False,
) -> ChannelHistory:
    """Run ``steps`` steps through a compiled graph in the connected Ray; stop at the first error.

    The caller has called ``ray.init`` and, for the blocking reads, set
    ``RAY_CGRAPH_get_timeout`` (their only bound; ``step_timeout`` bounds the others).
    ``node_resource`` pins the actors to the node that advertises that custom resource
    (the remote node). ``workers``: one actor per worker of the last stage, a multi-output
    graph as vLLM's. ``kv_connector``: read every worker's output through vLLM's
    ``KVOutputAggregator``. A step whose output is not rank 0's, lacks a worker's finished
    KV send, or comes back as the other read's type ends the run as ``WrongOutput``.
    """
    from concurrent.futures import Future

    import ray
    from ray.dag import InputNode, MultiOutputNode

    options = {"resources": {node_resource: 0.01}} if node_resource else {}
    # The actor's worker imports vLLM while this process does: on two cores each driver
    # run starts sooner than with the imports one after the other.
    actors = [_producer_class().options(**options).remote(shape) for _ in range(workers)]
    from vllm.v1.executor.ray_executor import RayDistributedExecutor

    detach.apply(mode)
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute_model.bind(inp, rank, kv_connector) for rank, a in enumerate(actors)])
    # vLLM's executor, given only what its read of a step uses: the compiled graph (built here from
    # these actors, as vLLM builds it from its workers), whether a KV connector is configured, and
    # its aggregator. Its __init__ would start vLLM's workers.
    executor = RayDistributedExecutor.__new__(RayDistributedExecutor)
    executor.forward_dag = dag.experimental_compile()
    executor.has_connector = kv_connector
    executor.kv_output_aggregator = None
    if kv_connector:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        executor.kv_output_aggregator = KVOutputAggregator(expected_finished_count=workers)
    history = ChannelHistory(mode)
    kept: list[Any] = []  # outputs stay referenced, as the scheduler keeps them
    try:
        for step in range(steps):
            start = time.monotonic()
            non_block = step % 2 == 0
            try:
                read = executor._execute_dag(step, None, non_block=non_block)
                if isinstance(read, Future) != non_block:
                    output = None  # the other read's type: WrongOutput
                elif non_block:
                    output = read.result(timeout=first_timeout if step == 0 else step_timeout)
                else:
                    output = read
            except Exception as exc:  # RayChannelTimeoutError and friends
                history.steps.append(StepRecord(step, time.monotonic() - start, type(exc).__name__))
                break
            kept.append(output)
            history.steps.append(StepRecord(step, time.monotonic() - start))
            if output is None or output.sampled_token_ids[0] != [step] or (
                kv_connector and output.kv_connector_output.finished_sending != {_finished_req(step)}
            ):
                history.steps[-1].error = "WrongOutput"
                break
    finally:
        kept.clear()
        try:
            executor.forward_dag.teardown()
        except Exception as exc:
            logger.warning("compiled graph teardown: %s", exc)
        for actor in actors:
            ray.kill(actor)
    return history


def main(argv: list[str] | None = None) -> None:
    """Run the graph as a driver process and print the history as one JSON line.

    A driver whose graph stalled can crash in Ray's teardown at exit, so tests
    run it as a child process; it leaves with ``os._exit`` right after printing.
    """
    import argparse
    import dataclasses
    import json
    import os
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--node-ip", required=True, help="this driver's loopback address")
    parser.add_argument("--mode", required=True, choices=[m.value for m in PatchMode])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--node-resource", default=None)
    parser.add_argument("--prompt-len", type=int, default=0)
    parser.add_argument("--sampling-mask", action="store_true")
    parser.add_argument("--step-timeout", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=1, help="workers of the last stage (TP): one actor each")
    parser.add_argument("--kv-connector", action="store_true",
                        help="read every worker's output through vLLM's KV-output aggregator")
    args = parser.parse_args(argv)

    import ray

    ray.init(address=args.address, _node_ip_address=args.node_ip, logging_level="ERROR")
    history = run_compiled_graph(
        PatchMode(args.mode),
        args.steps,
        OutputShape(prompt_len=args.prompt_len, sampling_mask=args.sampling_mask),
        node_resource=args.node_resource,
        step_timeout=args.step_timeout,
        workers=args.workers,
        kv_connector=args.kv_connector,
    )
    print(json.dumps({"mode": history.mode.value, "steps": [dataclasses.asdict(s) for s in history.steps]}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
