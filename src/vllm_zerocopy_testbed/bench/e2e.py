"""End-to-end latency and throughput: the cluster per mode beside a single-process vLLM, in one run.

Streamed requests (so that time to first token is seen): prompt_embeds just past
the out-of-band limit, and logprobs k=5; then 2 x max-num-seqs concurrent
requests for throughput, and as many regex-constrained ones (structured outputs:
the grammar bitmask goes to the last stage inside ``sample_tokens``; with this
512-token model it stays in band, the suite ``structured`` takes the large one). The same requests go to the single-process reference
first; every cluster figure is also given as a ratio to the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm_zerocopy_testbed.checker.latency import percentile
from vllm_zerocopy_testbed.cluster import cluster_from_env
from vllm_zerocopy_testbed.cluster.reference import ReferenceServer
from vllm_zerocopy_testbed.config import Executor, PatchMode
from vllm_zerocopy_testbed.host_config import ClusterSettings, Profile
from vllm_zerocopy_testbed.workload.catalog import EmbedsSizes, concurrent_specs, structured_specs
from vllm_zerocopy_testbed.workload.embeds import token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds, History, Record
from vllm_zerocopy_testbed.workload.runner import Runner

TOKENS = 16


@dataclass(frozen=True)
class LatencyFigure:
    """One (server, workload) row: seconds, and tokens/s for the throughput workload."""

    server: str
    workload: str
    requests: int
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    per_token_p50: float
    total_p50: float
    total_p95: float
    total_p99: float
    tokens_per_s: float


def _workloads(sizes: EmbedsSizes, repeats: int, concurrency: int) -> dict[str, list[CompletionSpec]]:
    ids = tuple(token_ids(sizes.out_of_band, seed=7))
    return {
        "embeds-1MiB": [CompletionSpec("bench/embeds", embeds=(Embeds(ids),), max_tokens=TOKENS, logprobs=5,
                                       stream=True)] * repeats,
        "logprobs-k5": [CompletionSpec("bench/logprobs", prompt_ids=tuple(token_ids(16, seed=8)),
                                       max_tokens=TOKENS, logprobs=5, stream=True)] * repeats,
        f"concurrent-{concurrency}": concurrent_specs(concurrency),
        f"structured-{concurrency}": structured_specs(concurrency),
    }


def _figure(server: str, workload: str, records: list[Record], wall_s: float) -> LatencyFigure:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s or r.latency_s for r in ok]
    total = [r.latency_s for r in ok]
    tokens = [r.completion_tokens if r.completion_tokens is not None else len(r.choices[0].get("tokens", []))
              for r in ok]
    per_token = [(r.latency_s - (r.ttft_s or 0)) / max(1, n - 1) for r, n in zip(ok, tokens)]
    return LatencyFigure(server, workload, len(ok), percentile(ttft, 50), percentile(ttft, 95), percentile(ttft, 99),
                         percentile(per_token, 50), percentile(total, 50), percentile(total, 95),
                         percentile(total, 99), sum(tokens) / wall_s if wall_s else 0.0)


def _measure(server: str, base_url: str, settings: ClusterSettings, workloads: dict[str, list[CompletionSpec]],
             progress: Callable[[LatencyFigure], None]) -> list[LatencyFigure]:
    import time

    runner = Runner(base_url, settings["TESTBED_SERVED_MODEL"], History(), server, timeout_s=180)
    figures = []
    for name, specs in workloads.items():
        start = time.monotonic()
        concurrent = name.startswith(("concurrent", "structured"))
        records = runner.run(name, specs, concurrency=len(specs) if concurrent else 1)
        figure = _figure(server, name, records, time.monotonic() - start)
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{server} {name}: {len(failed)} requests failed, first: {failed[0].error}")
        figures.append(figure)
        progress(figure)
    return figures


def run(*, quick: bool, progress: Callable[[LatencyFigure], None],
        note: Callable[[str], None]) -> list[LatencyFigure]:
    """Reference, then a V2 cluster per mode (quick: only a cluster already up, if any, and no reference:
    starting the single-process server takes a minute, which breaks the quick run's 3 minutes)."""
    settings = ClusterSettings.from_env()
    sizes = EmbedsSizes.for_chunk(int(settings.values.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")))
    concurrency = 2 * int(settings["TESTBED_MAX_NUM_SEQS"])
    workloads = _workloads(sizes, 5 if quick else 10, concurrency)
    modes = [PatchMode.UPSTREAM, PatchMode.TESTBED]
    profiles = [Profile(Executor.V2, m, m) for m in modes]
    if quick:
        running = [p for p in profiles if cluster_from_env(overrides=p.env()).serves(p.env())]
        if not running:
            note("e2e latency skipped (--quick starts no cluster; `make up` first to include it)")
            return []
        profiles = running[:1]
        note("e2e: the cluster only, no single-process reference (--quick starts no server; full run has it)")
    figures = []
    if not quick:
        with ReferenceServer(settings) as reference:
            figures += _measure("single-process", reference.base_url, settings, workloads, progress)
    for profile in profiles:
        figures += _on_cluster(profile, workloads, progress)
    return figures


def _on_cluster(profile: Profile, workloads: dict[str, list[CompletionSpec]],
                progress: Callable[[LatencyFigure], None]) -> list[LatencyFigure]:
    """Measure ``workloads`` on the profile's cluster: the running one if it serves the profile, else a fresh one."""
    backend = cluster_from_env(up_timeout=900, overrides=profile.env())
    if backend.serves(profile.env()):
        return _measure(str(profile), backend.base_url, backend.settings, workloads, progress)
    with backend:
        return _measure(str(profile), backend.base_url, backend.settings, workloads, progress)


def _plain_workloads(concurrency: int) -> dict[str, list[CompletionSpec]]:
    """Requests without logprobs: what the compiled graph answers with and without the issue-5 fix."""
    return {
        "plain-sequential": [CompletionSpec("bench/plain", prompt_ids=tuple(token_ids(16, seed=9)),
                                            max_tokens=TOKENS, stream=True)] * 5,
        f"plain-concurrent-{concurrency}": [
            CompletionSpec(f"bench/plain/{i}", prompt_ids=tuple(token_ids(8 + i % 7, seed=300 + i)),
                           max_tokens=TOKENS) for i in range(concurrency)],
    }


def run_inflight(*, quick: bool, progress: Callable[[LatencyFigure], None],
                 note: Callable[[str], None]) -> list[LatencyFigure]:
    """What the issue-5 fix costs: the compiled-graph cluster with PP executions in flight (upstream)
    and with one (testbed), on requests without logprobs (upstream deadlocks on logprobs)."""
    settings = ClusterSettings.from_env()
    workloads = _plain_workloads(2 * int(settings["TESTBED_MAX_NUM_SEQS"]))
    figures = []
    for mode in (PatchMode.UPSTREAM, PatchMode.TESTBED):
        figures += _on_cluster(Profile(Executor.CGRAPH, mode, mode), workloads, progress)
    by = {(f.server, f.workload): f for f in figures}
    for workload in workloads:
        up, ours = by.get(("cgraph/upstream", workload)), by.get(("cgraph/testbed", workload))
        if up and ours and up.tokens_per_s:
            note(f"in-flight cap on {workload}: {ours.tokens_per_s / up.tokens_per_s:.2f} x upstream's "
                 f"tokens/s, total p50 {ours.total_p50 / up.total_p50:.2f} x")
    return figures
