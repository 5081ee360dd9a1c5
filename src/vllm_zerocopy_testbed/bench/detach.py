"""What the detach itself costs, testbed vs upstream, on one output of many requests per field shape.

The channel part times whole compiled-graph steps, where the detach is a sliver; this
part times the detach function alone on a ``ModelRunnerOutput`` as Ray's channel hands
it over (numpy arrays read-only, torch tensors already copied by Ray), one shape per
field upstream's function knows: logprobs (k=20), plus ``prompt_logprobs_dict`` (torch),
plus ``pooler_output`` (torch), plus auxiliary rows (numpy, one array per request).
The three modes' functions (``upstream``: vLLM's as installed; ``testbed``: ours; ``off``: none,
the call alone) take turns output by output, each on an output of its own built before the clock
starts; ``/ upstream`` is the median of each round's ratio, with its 95% interval and upstream's
ratio to itself (the noise). Beside them, ``memcpy``: one copy of as many bytes as the output's
read-only arrays hold (what copying them costs at the least).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vllm_zerocopy_testbed.bench.stats import Ratio, Sample, interleaved, memcpy, paired, sample, self_ratio

SHAPES = ("logprobs", "prompt_logprobs", "pooler_output", "aux_rows")
NUM_REQS = 2048
VARIANTS = ("upstream", "testbed", "off")


@dataclass(frozen=True)
class DetachFigure:
    shape: str
    variant: str
    num_reqs: int
    detach: Sample
    ratio: Ratio | None = None  # testbed and off: round-by-round ratio to upstream, with its interval
    noise: Ratio | None = None  # upstream against itself
    copied_bytes: int = 0  # the output's read-only array bytes
    memcpy: Sample | None = None  # one copy of that many bytes


def _frozen(array: np.ndarray) -> np.ndarray:
    """A read-only view over immutable bytes, as Ray's channel deserializes an array."""
    return np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)


class _Outputs:
    """Fresh channel-like outputs of one shape: what changes per output is rebuilt, the rest shared."""

    def __init__(self, shape: str, num_reqs: int) -> None:
        import torch

        from vllm_zerocopy_testbed.harness.ray_channel import OutputShape, make_output

        self.shape = shape
        self.base = make_output(0, OutputShape(num_reqs=num_reqs, num_logprobs=20,
                                               prompt_len=8 if shape == "prompt_logprobs" else 0))
        self.arrays = [np.ascontiguousarray(a) for a in self.base.logprobs[:3]]
        self.pooler = [torch.randn(64) for _ in range(num_reqs)] if shape == "pooler_output" else None
        rng = np.random.default_rng(1)
        self.rows = ([rng.integers(0, 64, size=(4, 8), dtype=np.int32) for _ in range(num_reqs)]
                     if shape == "aux_rows" else None)

    @property
    def readonly_bytes(self) -> int:
        """Bytes in the read-only arrays of each fresh output (what a detach must copy)."""
        return sum(a.nbytes for a in self.arrays) + sum(r.nbytes for r in self.rows or ())

    def fresh(self) -> Any:
        import copy

        out = copy.copy(self.base)
        out.logprobs = type(self.base.logprobs)(*(_frozen(a) for a in self.arrays), self.base.logprobs[3])
        if self.pooler is not None:
            out.pooler_output = self.pooler
        if self.rows is not None:
            from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

            out.aux_output_connector_output = {r: AuxRequestOutput(0, _frozen(rows))
                                               for r, rows in zip(out.req_ids, self.rows)}
        return out


def run(*, quick: bool, progress: Callable[[DetachFigure], None]) -> list[DetachFigure]:
    """Time the three modes' detach functions per shape, in this process; return the figures."""
    from vllm_zerocopy_testbed.config import PatchMode
    from vllm_zerocopy_testbed.patches.detach import resolve

    functions = {variant: resolve(PatchMode(variant)) for variant in VARIANTS}
    figures = []
    for shape in SHAPES:
        outputs = _Outputs(shape, NUM_REQS)

        def timer(function: Callable[[Any], None]) -> Callable[[], float]:
            def once() -> float:
                output = outputs.fresh()
                start = time.perf_counter()
                function(output)
                return (time.perf_counter() - start) * 1e3
            return once

        timers = {name: timer(f) for name, f in functions.items()}
        for once in list(timers.values()) * 3:
            once()
        floor = memcpy(outputs.readonly_bytes, 0.5 if quick else 1.0)
        times = interleaved(timers, min_n=20, max_n=400 if not quick else 100, budget_s=2.0 if quick else 6.0)
        base = times["upstream"]
        for variant in VARIANTS:
            figure = DetachFigure(shape, variant, NUM_REQS, sample(times[variant]),
                                  paired(times[variant], base) if variant != "upstream" else None,
                                  self_ratio(base) if variant == "testbed" else None,
                                  outputs.readonly_bytes, floor)
            figures.append(figure)
            progress(figure)
    return figures
