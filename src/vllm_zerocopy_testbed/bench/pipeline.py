"""What the in-flight cap (patches/inflight.py) costs where the pipeline is the bottleneck: PP overlap lost.

On the CPU cluster each node has one core shared by its two TP ranks, and the
e2e ``inflight`` part found the cap free there. Where a stage's work is device
time (a GPU runs the layers while the host waits), PP=2 overlaps the stages: stage
0 runs execution N+1 while stage 1 runs N. This part measures exactly that, on
a real Ray compiled graph of vLLM's shape (PP=2 x TP=2 actors, stage 0 on the
driver's node, stage 1 on a second Ray node, the driver reading one output per
last-stage rank): each rank holds its step for ``STAGE_MS`` without using a core,
and the driver keeps as many executions in flight as vLLM's own ``VllmConfig``
says for that shape in each mode, read live with the Ray cluster up
(``TESTBED_INFLIGHT=upstream``: vLLM's value; ``testbed``: the cap). The two
in-flight counts take turns round by round; ``/ upstream`` is the median of the
rounds' ratios. Outputs are Python ints: no zero-copy buffer is held, so the
issue-5 deadlock cannot happen and only the overlap differs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from vllm_zerocopy_testbed.bench.ray_child import run_driver
from vllm_zerocopy_testbed.bench.stats import Sample, interleaved, paired, sample

STAGE_MS = 20.0
EXECUTIONS_PER_ROUND = 20
_DRIVER_IP, _STAGE1_IP = "127.0.0.3", "127.0.0.2"
_STAGE0, _STAGE1 = "testbed_stage0", "testbed_stage1"


@dataclass(frozen=True)
class PipelineFigure:
    mode: str  # upstream | testbed: whose in-flight count
    inflight: int
    stage_ms: float
    execution: Sample  # per execution at steady state (ms)
    vs_upstream: float | None = None
    vs_upstream_spread: float | None = None


def vllm_inflight_by_mode() -> dict[str, int]:
    """``max_concurrent_batches`` of a compiled-graph PP=2 x TP=2 Ray ``VllmConfig`` per inflight mode,
    in this process (Ray must be connected: the cap asks whether it has several nodes)."""
    from vllm_zerocopy_testbed.config import PatchMode
    from vllm_zerocopy_testbed.harness.cgraph_deadlock import compiled_graph_inflight
    from vllm_zerocopy_testbed.patches import inflight

    counts = {}
    for mode in (PatchMode.UPSTREAM, PatchMode.TESTBED):
        inflight.apply(mode)
        counts[mode.value] = compiled_graph_inflight()
    inflight.apply(PatchMode.UPSTREAM)
    return counts


def _driver(address: str, stage_ms: float, budget_s: float) -> None:
    """Child process: one PP=2 x TP=2 graph, both in-flight counts through it; print JSON, ``os._exit``."""
    import importlib

    import ray
    from ray.dag import InputNode, MultiOutputNode

    # As vLLM's driver has it (bench/channel.py: without it Ray crashed on a cross-node graph).
    importlib.import_module("vllm.v1.executor.ray_utils")
    ray.init(address=address, _node_ip_address=_DRIVER_IP, logging_level="ERROR")
    counts = vllm_inflight_by_mode()

    @ray.remote(num_cpus=0)
    class Rank:
        def step(self, value: int) -> int:
            time.sleep(stage_ms / 1e3)  # the stage's device time: no core held
            return value + 1  # a Python int: no zero-copy buffer the driver could hold

    stage0 = [Rank.options(resources={_STAGE0: 0.01}).remote() for _ in range(2)]
    stage1 = [Rank.options(resources={_STAGE1: 0.01}).remote() for _ in range(2)]
    with InputNode() as inp:
        hidden = [rank.step.bind(inp) for rank in stage0]
        dag = MultiOutputNode([rank.step.bind(h) for rank, h in zip(stage1, hidden)])
    compiled = dag.experimental_compile(_max_inflight_executions=max(counts.values()))

    def timer(inflight: int) -> Callable[[], float]:
        def once() -> float:
            pending = []
            start = time.perf_counter()
            for _ in range(EXECUTIONS_PER_ROUND):
                pending.append(compiled.execute(0))
                if len(pending) >= inflight:
                    outputs = [ref.get(timeout=60) for ref in pending.pop(0)]
                    del outputs  # dropped at once: no held channel buffer
            while pending:
                outputs = [ref.get(timeout=60) for ref in pending.pop(0)]
                del outputs
            return (time.perf_counter() - start) * 1e3 / EXECUTIONS_PER_ROUND
        return once

    timers = {mode: timer(count) for mode, count in counts.items()}
    for once in list(timers.values()) * 2:
        once()  # warm: channels allocated, actors scheduled
    times = interleaved(timers, min_n=5, max_n=40, budget_s=budget_s)
    results = []
    for mode, count in counts.items():
        ratio, step = paired(times[mode], times["upstream"]), sample(times[mode])
        results.append({"mode": mode, "inflight": count, "stage_ms": stage_ms, "median_ms": step.median_ms,
                        "spread": step.spread, "n": step.n, "vs_upstream": ratio.median,
                        "vs_upstream_spread": ratio.spread})
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


def run(*, quick: bool, progress: Callable[[PipelineFigure], None],
        note: Callable[[str], None] = print) -> list[PipelineFigure]:
    """Two fresh local Ray nodes (stage 0 with the driver, stage 1 apart) and a driver child; the figures."""
    from vllm_zerocopy_testbed.cluster.local_ray import RayNodeSpec

    nodes = [RayNodeSpec(_DRIVER_IP, resources={_STAGE0: 1}), RayNodeSpec(_STAGE1_IP, resources={_STAGE1: 1})]
    rows = run_driver(nodes, "from vllm_zerocopy_testbed.bench.pipeline import _driver; "
                      f"_driver(ADDRESS, {STAGE_MS!r}, {5.0 if quick else 15.0})", name="pipeline", note=note)
    figures = []
    for r in rows:
        figure = PipelineFigure(r["mode"], r["inflight"], r["stage_ms"], Sample(r["median_ms"], r["spread"], r["n"]),
                                r["vs_upstream"], r["vs_upstream_spread"])
        figures.append(figure)
        progress(figure)
    up = next((f for f in figures if f.mode == "upstream"), None)
    ours = next((f for f in figures if f.mode == "testbed"), None)
    if up and ours:
        note(f"in-flight cap on a pipeline-bound PP=2 x TP=2 compiled graph ({STAGE_MS:g} ms per stage): "
             f"{ours.inflight} in flight takes {ours.vs_upstream:.2f} x the time per execution of upstream's "
             f"{up.inflight} (throughput {1 / ours.vs_upstream:.2f} x)")
    return figures
