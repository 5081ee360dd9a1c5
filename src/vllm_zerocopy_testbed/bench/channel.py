"""What detaching costs on Ray's compiled-graph channel, beside not detaching and converting to lists.

A 2-node compiled graph (this driver on 127.0.0.3, the producer actor on
127.0.0.2) returns logprobs-shaped ``ModelRunnerOutput``s of growing size
(``num_reqs`` rows of k=20, made fresh each step as a model runner does; that
cost is in every variant). Per step, from ``execute`` until the driver holds
an output it may keep:

- ``none``: the read-only zero-copy arrays as they arrive (the driver drops
  them at once here; kept, they stall the channel: vLLM#35319);
- ``detach``: the testbed's detach (copy every read-only array);
- ``lists``: the actor converts the arrays to Python lists before returning
  (upstream PR 41218's approach): nothing to detach, larger pickles.

One graph serves all three: the step's input says whether the actor converts
to lists, the driver decides whether to detach. The variants take turns step by
step, so ``/ none`` is the median of each round's ratio to that round's ``none``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from vllm_zerocopy_testbed.bench.ray_child import run_driver
from vllm_zerocopy_testbed.bench.stats import Sample, interleaved, paired, sample

VARIANTS = ("none", "detach", "lists")
FULL_REQS = (8, 64, 512, 2048)
QUICK_REQS = (64, 2048)
_DRIVER_IP, _ACTOR_IP = "127.0.0.3", "127.0.0.2"
_REMOTE = "testbed_bench_node"


@dataclass(frozen=True)
class ChannelFigure:
    variant: str
    num_reqs: int
    step: Sample
    # Round-by-round ratio to ``none`` (steps of the same round): median and spread.
    vs_none: float | None = None
    vs_none_spread: float | None = None


def _driver(address: str, reqs: list[int], budget_s: float) -> None:
    """Child process (``ray_child.run_driver``): one compiled graph, every size and variant through it;
    print JSON, ``os._exit``."""
    import numpy as np
    import ray
    from ray.dag import InputNode

    from vllm_zerocopy_testbed.harness.ray_channel import OutputShape, make_output
    from vllm_zerocopy_testbed.patches.detach import detach_output

    # Import vLLM's executor side before the graph runs, as vLLM's own driver has it: without
    # it the second read of the graph timed out and Ray crashed (driver -11, remote raylet
    # check in experimental_mutable_object_provider.cc), whatever the output's size.
    importlib.import_module("vllm.v1.executor.ray_utils")
    ray.init(address=address, _node_ip_address=_DRIVER_IP, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Producer:
        """A fresh output per step, as a model runner makes one; as lists when asked."""

        def __init__(self) -> None:
            self.steps = 0

        def step(self, request: tuple[int, bool]) -> Any:
            num_reqs, as_lists = request
            self.steps += 1
            output = make_output(self.steps, OutputShape(num_reqs=num_reqs, num_logprobs=20))
            if as_lists:
                lp = output.logprobs
                output.logprobs = type(lp)(*(x.tolist() if isinstance(x, np.ndarray) else x for x in lp))
            return output

    actor = Producer.options(resources={_REMOTE: 0.01}).remote()
    with InputNode() as inp:
        dag = actor.step.bind(inp)
    compiled = dag.experimental_compile()
    compiled.execute((reqs[0], False)).get(timeout=180)  # the actor's first step imports torch and vLLM
    results = []
    for num_reqs in reqs:
        def timer(variant: str) -> Callable[[], float]:
            def once() -> float:
                start = time.perf_counter()
                output = compiled.execute((num_reqs, variant == "lists")).get(timeout=60)
                if variant == "detach":
                    detach_output(output)
                elapsed = (time.perf_counter() - start) * 1e3
                del output  # drop zero-copy views before the next read
                return elapsed
            return once

        timers = {variant: timer(variant) for variant in VARIANTS}
        for once in list(timers.values()) * 3:
            once()
        times = interleaved(timers, min_n=10, max_n=300, budget_s=budget_s * len(VARIANTS))
        for variant in VARIANTS:
            step, ratio = sample(times[variant]), paired(times[variant], times["none"])
            results.append({"variant": variant, "num_reqs": num_reqs, "median_ms": step.median_ms,
                            "spread": step.spread, "n": step.n, "vs_none": ratio.median,
                            "vs_none_spread": ratio.spread})
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


def run(*, quick: bool, progress: Callable[[ChannelFigure], None],
        note: Callable[[str], None] = print) -> list[ChannelFigure]:
    """Two fresh local Ray nodes and a driver child process; return the figures."""
    from vllm_zerocopy_testbed.cluster.local_ray import RayNodeSpec

    reqs = QUICK_REQS if quick else FULL_REQS
    nodes = [RayNodeSpec(_DRIVER_IP), RayNodeSpec(_ACTOR_IP, resources={_REMOTE: 1})]
    rows = run_driver(nodes, "from vllm_zerocopy_testbed.bench.channel import _driver; "
                      f"_driver(ADDRESS, {list(reqs)!r}, {1.0 if quick else 2.0})", name="channel", note=note)
    figures = []
    for r in rows:
        figure = ChannelFigure(r["variant"], r["num_reqs"], Sample(r["median_ms"], r["spread"], r["n"]),
                               r["vs_none"], r["vs_none_spread"])
        figures.append(figure)
        progress(figure)
    return figures
