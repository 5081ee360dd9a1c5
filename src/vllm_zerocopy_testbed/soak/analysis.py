"""What a soak's samples and records say: growth rates against budgets, per-minute latency,
answers that drifted from their first, structured answers outside their grammar.

Pure functions over data (``Sample``, ``Record``): the unit tests feed them made-up series.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Iterable

from vllm_zerocopy_testbed.checker import Verdict, bitexact
from vllm_zerocopy_testbed.checker.latency import percentile
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Record

# Growth allowed per node, per hour, past the warm-up. What each would cost in a day: RSS
# 1.5 GiB (a node container has 2 GiB of /dev/shm and shares the machine's memory), /dev/shm
# 24 MiB, 48 files, 240 descriptors, 384 MiB of object store. A leak of one small object per
# request (~3 requests/s here) passes none of them. heap_in_use_mb (vLLM processes' C heap in
# use, observe/heap.py) has RSS's budget: RSS can pass it only if live memory does.
# python_blocks (objects and buffers Python's allocator holds in the vLLM processes): 50,000 an
# hour is about 5 per request at the soak's ~10,000 requests an hour; a leak of Python objects
# shows here first (a planted list of every output: +2,250,000 an hour).
BUDGETS_PER_HOUR = {"rss_mb": 64.0, "heap_in_use_mb": 64.0, "python_blocks": 50000.0, "shm_mb": 1.0, "shm_files": 2.0,
                    "fds": 10.0, "object_store_mb": 16.0}
UNITS = {"rss_mb": "MB", "heap_in_use_mb": "MB", "heap_free_mb": "MB", "shm_mb": "MB", "shm_files": "files",
         "fds": "fds", "object_store_mb": "MB", "processes": "processes", "object_store_objects": "objects",
         "python_blocks": "blocks", "context_vars": "variables", "onednn_cached": "primitives"}
# Fitted and reported beside the budgeted ones, without a budget of their own: where RSS goes.
EXPLAINING = {"heap_free_mb": float("inf"), "context_vars": float("inf"), "onednn_cached": float("inf")}


@dataclass(frozen=True)
class KnownGrowth:
    """A growth already found and reported upstream, told from any other by its signature: a
    figure that counts it (``signature``, per node) and what each unit of it costs in the
    budgeted figures (``cost``, measured outside the soak, never fitted to the soak's own data: a
    new leak that grows with the same steps is not absorbed). A node's budgeted growth is judged
    without the known part: its signature's rate times the cost."""

    name: str  # a finding's folder (findings/<name>) or a cause docs/soak.md names
    signature: str
    cost: dict[str, float]
    what: str

    def explains(self, signature_per_hour: float, metric: str) -> float:
        return max(0.0, signature_per_hour) * self.cost.get(metric, 0.0)


KNOWN_GROWTH = (
    KnownGrowth(
        "contextvar-per-forward", "context_vars",
        # Per variable, measured (docs/soak.md, "The known growth"): 100,000 functorch_config.patch()
        # calls in torch 2.13.0 add 235 bytes of RSS and 2.37 Python blocks each, 0.6 bytes of glibc
        # heap (the objects live in pymalloc's arenas); in an engine in process (vLLM 0.32.0, 8,000
        # forwards) 0-240 bytes of RSS, 2.4-3.8 blocks, 0-4 bytes of heap per forward, one variable each.
        cost={"rss_mb": 235.0 / 2**20, "python_blocks": 2.37},
        what="torch's config.patch() leaves a ContextVar per forward pass (vLLM computes its AOT cache key on "
             "every call)"),
    KnownGrowth(
        "onednn-primitive-cache", "onednn_cached",
        # Per primitive, the lower of two measurements (a cost too high would hide other growth):
        # the soak's own model on the cluster, a stream's first minute (reports/soak-5m-signature:
        # +372 primitives, +69.9 MB of heap in use on the head; +276, +56.0 MB on the worker:
        # 0.19-0.20 MB, an upper bound, as other caches fill then too), and an engine in process
        # (vLLM 0.32.0's oneDNN GEMM, another tiny Llama: 152 lines, +46 MB: 0.30 MB). A bounded
        # cache, not a leak: its signature stops growing at the capacity (node/usage.py).
        cost={"heap_in_use_mb": 0.19, "rss_mb": 0.19},
        what="oneDNN's primitive cache filling, one primitive per new (matrix shape, token count) in vLLM's CPU "
             "GEMM, up to ONEDNN_PRIMITIVE_CACHE_CAPACITY (1024) per process"),
    KnownGrowth(
        "glibc-kept", "heap_free_mb",
        # Resident but free: memory glibc's heap keeps after the process freed it (fragmentation; its
        # mmap threshold rises after large frees). Counted by the same processes' heap probes: a leak
        # (memory in use) cannot hide in it.
        cost={"rss_mb": 1.0},
        what="memory the vLLM processes freed and glibc's heap keeps (docs/soak.md: MALLOC_MMAP_THRESHOLD_=131072 "
             "removes it)"),
)


@dataclass(frozen=True)
class Sample:
    """One node's figures (``node/usage.py``) at ``at`` (seconds since the soak began)."""

    at: float
    node: str
    figures: dict[str, float]
    error: str = ""  # the node could not be sampled (gone, restarting): no figures

    def to_json(self) -> dict:
        return {"at": round(self.at, 1), "node": self.node, "figures": self.figures, "error": self.error}


def _slopes(points: list[tuple[float, float]]) -> list[float]:
    return sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1)


def theil_sen(points: list[tuple[float, float]]) -> float:
    """The median of the slopes between every pair of points (robust to a few outliers, where a
    least-squares fit follows one spike); 0.0 for fewer than two distinct times."""
    slopes = _slopes(points)
    return statistics.median(slopes) if slopes else 0.0


Z_ONE_SIDED_95 = 1.645


def theil_sen_lower(points: list[tuple[float, float]], z: float = Z_ONE_SIDED_95) -> float:
    """A one-sided lower confidence bound (95%) of the Theil-Sen slope (Sen 1968: a rank among the
    sorted pairwise slopes, from Kendall's tau's variance): what the samples show at least. Short
    or noisy series get a low bound; a figure fails its budget only when its bound does, so a 5
    min window catches large leaks and says nothing false about small ones."""
    slopes = _slopes(points)
    if not slopes:
        return 0.0
    n = len(points)
    spread = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    rank = int(math.floor((len(slopes) - spread) / 2.0))  # 1-based rank of the bound
    return slopes[max(0, rank - 1)]


@dataclass
class Growth:
    node: str
    metric: str
    per_hour: float
    budget: float
    first: float
    last: float
    samples: int
    known: float = 0.0  # per hour, the part known growths' signatures account for
    known_as: str = ""  # their names
    low: float | None = None  # per hour, the slope's lower 95% bound (theil_sen_lower); None: per_hour

    @property
    def lower(self) -> float:
        return self.per_hour if self.low is None else self.low

    @property
    def unknown_low(self) -> float:
        """What the samples show at least (95%) past the known part: what the budget judges."""
        return self.lower - self.known

    @property
    def ok(self) -> bool:
        return self.unknown_low <= self.budget

    def to_json(self) -> dict:
        return {"node": self.node, "metric": self.metric, "per_hour": round(self.per_hour, 3),
                "budget_per_hour": self.budget, "first": round(self.first, 2), "last": round(self.last, 2),
                "samples": self.samples, "known_per_hour": round(self.known, 3), "known_as": self.known_as,
                "lower_bound_per_hour": round(self.lower, 3), "ok": self.ok}


def _series(samples: Iterable[Sample], warmup_s: float, metrics: Iterable[str]) -> dict[tuple[str, str], list]:
    metrics = set(metrics)
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for sample in samples:
        if sample.error or sample.at < warmup_s:
            continue
        for metric in metrics & sample.figures.keys():
            series.setdefault((sample.node, metric), []).append((sample.at, sample.figures[metric]))
    return series


def _signature_rates(series: dict[tuple[str, str], list], known: Iterable[KnownGrowth]) -> list[tuple[str, KnownGrowth, float]]:
    """(node, known growth, its signature's rate per hour) for each signature that grew."""
    rates = [(node, item, theil_sen(points) * 3600.0) for item in known
             for (node, metric), points in sorted(series.items()) if metric == item.signature]
    return [(node, item, rate) for node, item, rate in rates if rate > 0]


def growth(samples: Iterable[Sample], warmup_s: float, budgets: dict[str, float] = BUDGETS_PER_HOUR,
           known: Iterable[KnownGrowth] = KNOWN_GROWTH) -> list[Growth]:
    """Per node and budgeted metric: the growth rate (per hour) of the samples taken after
    ``warmup_s`` (caches and compiled kernels fill the first minutes), and the part of it the
    ``known`` growths' signatures account for (a node whose samples lack a signature: none). A
    metric a node never reported (a backend that cannot see it) is left out."""
    known = list(known)
    series = _series(samples, warmup_s, [*budgets, *(k.signature for k in known)])
    signatures = _signature_rates(series, known)
    found = []
    for (node, metric), points in sorted(series.items()):
        if metric not in budgets:
            continue
        rate = Growth(node, metric, theil_sen(points) * 3600.0, budgets[metric], points[0][1], points[-1][1],
                      len(points), low=theil_sen_lower(points) * 3600.0)
        for where, item, per_hour in signatures:
            part = item.explains(per_hour, metric) if where == node else 0.0
            if part > 0:
                rate.known += part
                rate.known_as = ", ".join(filter(None, [rate.known_as, item.name]))
        found.append(rate)
    return found


def known_growth(samples: Iterable[Sample], warmup_s: float,
                 known: Iterable[KnownGrowth] = KNOWN_GROWTH) -> list[str]:
    """One line per node and known growth whose signature grew: its rate and what it accounts for."""
    known = list(known)
    lines = []
    for node, item, rate in _signature_rates(_series(samples, warmup_s, [k.signature for k in known]), known):
        parts = ", ".join(f"{metric} {item.explains(rate, metric):+.1f} {UNITS[metric]}/hour" for metric in item.cost)
        lines.append(f"{node}: {item.name} (known: {item.what}): {item.signature} {rate:+,.0f}/hour, "
                     f"accounts for {parts}")
    return lines


PROCESS_PREFIX = "rss_mb/"


def process_growth(samples: Iterable[Sample], warmup_s: float, min_samples: int = 3,
                   prefix: str = PROCESS_PREFIX) -> list[Growth]:
    """Per node and process (``rss_mb/<name>[<pid>]``, the sampler's largest ones; another
    ``prefix``: ``heap_in_use_mb/``, ``heap_free_mb/``): the growth rate past the warm-up, largest
    first. No budget: it says where a node's growth is."""
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for sample in samples:
        if sample.error or sample.at < warmup_s:
            continue
        for key, value in sample.figures.items():
            if key.startswith(prefix):
                series.setdefault((sample.node, key.removeprefix(prefix)), []).append((sample.at, value))
    rates = [Growth(node, name, theil_sen(points) * 3600.0, float("inf"), points[0][1], points[-1][1], len(points))
             for (node, name), points in series.items() if len(points) >= min_samples]
    return sorted(rates, key=lambda r: -r.per_hour)


def where_rss_goes(rates: list[Growth], explaining: list[Growth]) -> list[str]:
    """For each node whose RSS grows past its budget: how much of it the heap probes account for,
    in use (a leak: something keeps allocating) against freed but kept by glibc (the allocator
    holding what the process let go: fragmentation, a raised mmap threshold), and the rest."""
    by = {(r.node, r.metric): r for r in [*rates, *explaining]}
    lines = []
    for rss in (r for r in rates if r.metric == "rss_mb" and r.per_hour > r.budget):  # known parts or not
        in_use, kept = by.get((rss.node, "heap_in_use_mb")), by.get((rss.node, "heap_free_mb"))
        if in_use is None or kept is None:
            lines.append(f"{rss.node}: RSS {rss.per_hour:+.0f} MB/hour; no heap figures (TESTBED_HEAP_PROBE_S=0, or "
                         "no vLLM process sampled): a leak and memory the allocator keeps look alike")
            continue
        rest = rss.per_hour - in_use.per_hour - kept.per_hour
        cause = ("memory in use grows: a leak" if not in_use.ok else
                 f"memory in use grows, but no more than the known growth ({in_use.known_as or 'none'}) and the "
                 "samples' spread allow: heap_in_use_mb passes" if in_use.per_hour > in_use.budget else
                 "freed memory kept by glibc's heap, not a leak" if kept.per_hour >= rest else
                 "outside the C heap (Python objects, mappings): see python_blocks")
        lines.append(f"{rss.node}: RSS {rss.per_hour:+.0f} MB/hour = heap in use {in_use.per_hour:+.0f} + freed but "
                     f"kept {kept.per_hour:+.0f} + rest {rest:+.0f}: {cause}")
    return lines


def check_growth(rates: list[Growth], min_samples: int = 3) -> Verdict:
    verdict = Verdict("growth")
    if not rates or max(r.samples for r in rates) < min_samples:
        verdict.fail(f"fewer than {min_samples} samples per node past the warm-up: no growth rate to judge "
                     "(a longer DURATION, or a shorter warm-up)")
    for rate in rates:
        if not rate.ok:
            known = (f", of which {rate.known:.2f} known ({rate.known_as})" if rate.known else "")
            verdict.fail(f"{rate.node} {rate.metric}: grows {rate.per_hour:.2f} {UNITS[rate.metric]}/hour{known}, "
                         f"at least {rate.unknown_low:.2f}{' not known' if rate.known else ''} (95% bound), budget "
                         f"{rate.budget:g} ({rate.first:.1f} -> {rate.last:.1f} over {rate.samples} samples)")
    return verdict


@dataclass
class Minute:
    minute: int
    requests: int = 0
    failed: int = 0
    p50_s: float = 0.0
    p99_s: float = 0.0

    def to_json(self) -> dict:
        return {"minute": self.minute, "requests": self.requests, "failed": self.failed,
                "p50_s": round(self.p50_s, 3), "p99_s": round(self.p99_s, 3)}


def per_minute(records: Iterable[Record], started: float) -> list[Minute]:
    """Requests by the minute they ended in (epoch ``started`` = minute 0): count, failures, p50/p99."""
    buckets: dict[int, list[Record]] = {}
    for record in records:
        buckets.setdefault(int((record.started + record.latency_s - started) // 60), []).append(record)
    minutes = []
    for minute in range(max(buckets, default=-1) + 1):
        rows = buckets.get(minute, [])
        latencies = [r.latency_s for r in rows if r.ok]
        minutes.append(Minute(minute, len(rows), sum(not r.ok for r in rows), percentile(latencies, 50),
                              percentile(latencies, 99)))
    return minutes


def check_structured(records: Iterable[Record], specs: Iterable[CompletionSpec]) -> Verdict:
    """A structured answer that ended by itself (``stop``) must match its regex in full; one cut at
    ``max_tokens`` (``length``) is not judged here (the first-answer check still is)."""
    verdict = Verdict("structured")
    regexes = {s.key: re.compile(s.regex) for s in specs if s.regex}
    judged = 0
    for record in records:
        if not record.ok or record.key not in regexes:
            continue
        for choice in record.choices:
            if choice.get("finish_reason") != "stop":
                continue
            judged += 1
            if not regexes[record.key].fullmatch(choice.get("text", "")):
                verdict.fail(f"{record.key}: {choice.get('text', '')!r} is outside its grammar "
                             f"{regexes[record.key].pattern!r}")
    verdict.figures["judged"] = judged
    return verdict


# Measured (4 min soak, 3 clients): the prompts past the ring chunk (4200 rows) are chunked
# differently when other requests share the step, and their logprobs move by up to 1.5e-6;
# tokens never. A transport fault changes far more (tokens, or logprobs well past this).
LOGPROB_TOLERANCE = 1e-5


def check_first_answers(records: Iterable[Record], firsts: dict[str, Record],
                        tolerance: float = LOGPROB_TOLERANCE) -> tuple[Verdict, list[str]]:
    """Each answer against the first answer of its request: tokens identical, logprobs within
    ``tolerance``. Also returns the keys with an answer that is not bit-identical (figures:
    ``bit_identical``, ``within_tolerance``)."""
    records = [r for r in records if r.ok]
    verdict = bitexact.check(records, firsts, tolerance=tolerance,
                             name=f"same as the first answer (tokens exact, logprobs within {tolerance:g})")
    moved = sorted({r.key for r in records if r.key in firsts and bitexact.differences(firsts[r.key], r)})
    identical = sum(r.key in firsts and not bitexact.differences(firsts[r.key], r) for r in records)
    verdict.figures.update(bit_identical=float(identical), within_tolerance=float(len(records) - identical))
    return verdict, moved


@dataclass
class Verdicts:
    """Every check of one soak, in report order."""

    items: list[Verdict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.items)
