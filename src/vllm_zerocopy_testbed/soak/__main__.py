"""``make soak DURATION=30m``: one cluster, a continuous mixed stream, per-minute checks, growth rates.

The workload: prompt_embeds at every transport size (in the ring, out of band, past the ring
chunk) and dtype, a batch of embeds, logprobs k=1..20, prompt_logprobs, structured outputs,
from ``--clients`` closed-loop clients (concurrent). Each answer must equal the first answer of
its request, bit for bit; no request may pass its bound; a structured answer must match its
grammar. Every ``--sample`` seconds, per node: resident memory, open descriptors, /dev/shm bytes
and files, Ray object store use (``node/usage.py``). At the end: each figure's growth rate
(per hour, after the warm-up) against its budget (``soak/analysis.py``), p50/p99 latency per
minute; ``soak.json``, ``soak.md``, ``soak.png`` and ``junit.xml`` in ``reports/<run>/``.
Exit status 1 when any check fails.

The cluster: one already up (``make up``) is used and left as found; otherwise it is brought
up and down (``TESTBED_CLUSTER`` picks the backend, as for the e2e suites).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source import running
from vllm_zerocopy_testbed.checker import Verdict, bitexact, timeouts
from vllm_zerocopy_testbed.cluster import cluster_from_env
from vllm_zerocopy_testbed.cluster.interface import Cluster, Unsupported
from vllm_zerocopy_testbed.config import NODE_ENV, REPO_ROOT
from vllm_zerocopy_testbed.host_config import ClusterSettings, E2ERun, parse_duration
from vllm_zerocopy_testbed.soak import analysis, report
from vllm_zerocopy_testbed.soak.analysis import Sample
from vllm_zerocopy_testbed.workload import catalog
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, History
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.stream import Stream

# Measured (reports/soak-5m-a): a Ray worker's heap in use grew 43 MB in the stream's first
# minute, 8-17 MB in each of the next two, then 7 and -4: caches and first-touched pages.
WARMUP = "5m"
MODES = re.compile(r"broadcast=\S+ detach=\S+(?: inflight=\S+)?")


def workload(settings: ClusterSettings) -> list[CompletionSpec]:
    """The mixed stream's requests: every transport size and dtype, logprobs, structured outputs."""
    sizes = catalog.EmbedsSizes.for_chunk(int(settings.values.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")))
    specs = [*catalog.embeds_specs(sizes), *catalog.embeds_batch_specs(), *catalog.logprobs_specs(max_tokens=8),
             *catalog.prompt_logprobs_specs(), *catalog.structured_specs(8)]
    # Interleave kinds, so that a client's next request is of another kind (mixed batches).
    by_kind: dict[str, list[CompletionSpec]] = {}
    for spec in specs:
        by_kind.setdefault(spec.key.split("/")[0], []).append(spec)
    mixed: list[CompletionSpec] = []
    while any(by_kind.values()):
        for kind in list(by_kind):
            if by_kind[kind]:
                mixed.append(by_kind[kind].pop(0))
    return mixed


class Sampler:
    """Samples every node of ``cluster`` every ``every_s`` in a thread (bounded calls); a node
    that cannot be sampled is recorded with the error, and the soak goes on."""

    def __init__(self, cluster: Cluster, started: float, every_s: float) -> None:
        self.cluster, self.started, self.every_s = cluster, started, every_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="soak-sampler")

    def sample_once(self) -> list[Sample]:
        taken = []
        for node in self.cluster.nodes():
            at = time.time() - self.started
            try:
                taken.append(Sample(at, node, self.cluster.usage(node)))
            except Unsupported:
                raise
            except Exception as exc:  # a node restarting, docker exec timing out: recorded, not fatal
                taken.append(Sample(at, node, {}, f"{type(exc).__name__}: {exc}"[:200]))
        self.samples += taken
        return taken

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_once()

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def _say(start: float, text: str) -> None:
    print(f"[{time.monotonic() - start:7.1f} s] {text}", flush=True)


# Set on the nodes a soak brings up: oneDNN logs each primitive it creates, the signature of its
# cache filling (node/usage.py: onednn_cached). A cluster already up is used as it is.
SIGNATURE_ENV = "ONEDNN_VERBOSE=profile_create"


def run(duration_s: float, out: Path, *, clients: int, sample_s: float, warmup_s: float) -> bool:
    start = time.monotonic()
    cluster = cluster_from_env(up_timeout=900)
    owned = not cluster.is_running()
    if owned and "ONEDNN_VERBOSE=" not in os.environ.get(NODE_ENV, ""):
        os.environ[NODE_ENV] = " ".join(filter(None, [os.environ.get(NODE_ENV, "").strip(), SIGNATURE_ENV]))
        cluster = cluster_from_env(up_timeout=900)
    settings = cluster.settings
    run_settings = E2ERun.from_env(settings)
    if owned:
        _say(start, f"soak: bringing up a {type(cluster).__name__} (none is up)")
        cluster.up()
    else:
        _say(start, f"soak: using the {type(cluster).__name__} already up (left as found)")
    try:
        return _soak(cluster, settings, run_settings.request_timeout_s, duration_s, out, start,
                     clients=clients, sample_s=sample_s, warmup_s=warmup_s)
    finally:
        if owned:
            _say(start, "soak: bringing the cluster down")
            cluster.down()


def _soak(cluster: Cluster, settings: ClusterSettings, timeout_s: float, duration_s: float, out: Path,
          start: float, *, clients: int, sample_s: float, warmup_s: float) -> bool:
    model = settings["TESTBED_SERVED_MODEL"]
    history = History()
    runner = Runner(cluster.base_url, model, history, "soak", timeout_s)
    specs = workload(settings)
    _say(start, f"soak: {len(specs)} distinct requests, first answers one at a time")
    firsts = runner.run("soak-first", specs)
    first_answers = bitexact.first_answers(firsts)
    modes = sorted({m.group(0) for m in map(MODES.search, _mode_lines(cluster)) if m})

    began = time.time()
    sampler = Sampler(cluster, began, sample_s)
    unsampled = ""
    try:
        sampler.sample_once()
        sampler.start()
    except Unsupported as exc:  # an observed cluster: answers and bounds only
        unsampled = str(exc)
        _say(start, f"soak: nodes not sampled ({unsampled}): no growth rates")
    stream = Stream(runner, specs, suite="soak", clients=clients).start()
    ends = began + warmup_s + duration_s  # the warm-up runs first; growth is fitted past it
    stream.stop(ends)
    minute, judged, drifted, not_identical = 0, 0, 0, 0
    while time.time() < ends:
        time.sleep(min(60.0, max(0.0, ends - time.time())))
        minute += 1
        records = list(stream.records)
        failed = sum(not r.ok for r in records)
        answered = [r for r in records[judged:] if r.ok]  # each judged once; the final verdict judges all
        if answered:
            same, _ = analysis.check_first_answers(answered, first_answers)
            drifted += len(same.problems)
            not_identical += int(same.figures.get("within_tolerance", 0))
        judged = len(records)
        latest = {s.node: s for s in sampler.samples}
        nodes = ", ".join(f"{n} rss {s.figures.get('rss_mb', 0):.0f} MB fds {s.figures.get('fds', 0):.0f}"
                          + (f" shm {s.figures['shm_mb']:.1f} MB" if "shm_mb" in s.figures else "")
                          + (f" heap {s.figures['heap_in_use_mb']:.0f} MB in use, {s.figures['heap_free_mb']:.0f} MB kept"
                             if "heap_in_use_mb" in s.figures else "")
                          if not s.error else f"{n}: {s.error}" for n, s in latest.items())
        last = analysis.per_minute(records, began)[-1:] or [analysis.Minute(0)]
        phase = " (warm-up)" if minute * 60 <= warmup_s else ""
        _say(start, f"soak {minute}/{-(-(warmup_s + duration_s) // 60):.0f} min{phase}: {len(records)} requests, {failed} failed, "
                    f"{drifted} divergent ({not_identical} within the logprob tolerance, not bit-identical); last minute p50 {last[0].p50_s:.2f} s p99 {last[0].p99_s:.2f} s; {nodes}")
    joined = stream.join(timeout_s + 30)
    if not unsampled:
        sampler.stop()
        sampler.sample_once()
    records = list(stream.records)

    same, moved = analysis.check_first_answers(records, first_answers)
    verdicts = analysis.Verdicts([
        timeouts.check(records),
        same,
        analysis.check_structured([*firsts, *records], specs),
        analysis.check_growth(analysis.growth(sampler.samples, warmup_s)) if not unsampled
        else Verdict(f"growth (not sampled: {unsampled})"),
    ])
    if not joined:
        verdicts.items[0].fail(f"a client was still waiting {timeout_s + 30:.0f} s after the stream stopped")
    if not all(r.ok for r in firsts):
        verdicts.items[0].fail(f"the first answers failed: {timeouts.check(firsts)}")
    meta = {"vllm": running(), "duration_s": duration_s, "clients": clients, "sample_s": sample_s, "warmup_s": warmup_s,
            "cluster": type(cluster).__name__, "modes": modes, "request_bound_s": timeout_s,
            "distinct_requests": len(specs), "node_env": settings.values.get("TESTBED_NODE_ENV", ""), "not_bit_identical": moved, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began))}
    written = report.write(out, meta, records, sampler.samples, began, warmup_s, verdicts)
    print((out / "soak.md").read_text(), flush=True)
    _say(start, "written: " + ", ".join(str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else str(p)
                                         for p in written))
    return verdicts.ok


def _mode_lines(cluster: Cluster) -> list[str]:
    try:
        return cluster.mode_lines()
    except Exception:  # an observed cluster without mode lines: the report says none
        return []


def _terminated(signum: int, _frame: object) -> None:
    print(f"soak: {signal.Signals(signum).name}: stopping (the report is not written)", flush=True)
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", default="30m", help="how long the stream runs past the warm-up, the window "
                        "whose growth is judged: 90s, 30m, 2h (default 30m)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent closed-loop clients (default 3)")
    parser.add_argument("--sample", default="30s", help="how often each node is sampled (default 30s, the heap "
                        "probes' period: more samples, a tighter bound on each slope)")
    parser.add_argument("--warmup", default=WARMUP, help="the stream runs this long before the judged window: "
                        f"caches, compiled kernels, first-touched pages fill (default {WARMUP})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        duration_s = parse_duration(args.duration)
        sample_s = parse_duration(args.sample)
        warmup_s = parse_duration(args.warmup)
    except ValueError as exc:
        parser.error(str(exc))
    if args.clients < 1:
        parser.error(f"--clients must be at least 1, got {args.clients}")
    out = args.out or REPO_ROOT / "reports" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    # A CI job's timeout (or `kill`) sends SIGTERM: end through run's finally, which brings down
    # the cluster this soak brought up, instead of leaving two node containers behind.
    signal.signal(signal.SIGTERM, _terminated)
    ok = run(duration_s, out, clients=args.clients, sample_s=sample_s, warmup_s=warmup_s)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
