"""``make bench``: broadcast, channel and end-to-end benchmarks; report in reports/bench-<time>/."""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source import running
from vllm_zerocopy_testbed.bench import arena, broadcast, channel, detach, e2e, pipeline, report
from vllm_zerocopy_testbed.config import REPO_ROOT

PARTS = ("broadcast", "arena", "channel", "pipeline", "e2e", "inflight")
# Opt-in: inflight (two more compiled-graph cluster starts, ~8 min, would break the 15 min budget).
DEFAULT_PARTS = ("broadcast", "arena", "channel", "pipeline", "e2e")
# Fewer sizes and repeats, e2e only against a cluster already up, no pipeline part (~60 s of Ray start).
QUICK_PARTS = ("broadcast", "arena", "channel", "e2e")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats, no cluster start (< 3 min)")
    parser.add_argument("--parts", default=None, help=f"comma-separated subset of {PARTS} (default: "
                        f"{','.join(DEFAULT_PARTS)}; with --quick {','.join(QUICK_PARTS)})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    parts = ([p for p in args.parts.split(",") if p] if args.parts is not None
             else list(QUICK_PARTS if args.quick else DEFAULT_PARTS))
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; use {', '.join(PARTS)}")
    out = args.out or REPO_ROOT / "reports" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    start = time.monotonic()
    notes: list[str] = []

    def say(text: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {text}", flush=True)

    results: dict[str, list] = {"broadcast": [], "arena": [], "channel": [], "detach": [], "pipeline": [], "e2e": []}
    floors = {}  # memcpy of every size the broadcast and arena parts send, before any reader starts
    with broadcast.one_copy_thread():
        if "broadcast" in parts or "arena" in parts:
            wanted = set(broadcast.sizes(args.quick) if "broadcast" in parts else ()) | set(
                arena.sizes(args.quick) if "arena" in parts else ())
            floors = broadcast.memcpy_floors(wanted, quick=args.quick)
            say("memcpy on one thread (the writer copies on one too): "
                + ", ".join(f"{n >> 10} KiB {s.median_ms:.3f} ms" for n, s in floors.items()))
        if "broadcast" in parts:
            say("broadcast: MessageQueue, upstream/testbed taking turns per message, then off")
            results["broadcast"] = broadcast.run(quick=args.quick, baselines=floors, progress=lambda f: say(
                f"  {f.topology:8} {f.nbytes >> 10:>7} KiB {f.mode:8} {f.message.median_ms:9.2f} ms/msg "
                f"(spread {f.message.spread:.0%}, n={f.message.n}, enqueue {f.enqueue_ms:.2f} ms, "
                f"{f.ratio_to_memcpy:.1f} x memcpy"
                + (f", {f.vs_upstream:.2f} x upstream" if f.vs_upstream is not None and f.mode != "upstream" else "")
                + ")"))
        if "arena" in parts:
            say("arena: vLLM 0.32's shm tensor arena, upstream/testbed taking turns, then off, beside memcpy; "
                "local readers, every page read")
            results["arena"] = arena.run(quick=args.quick, baselines=floors, progress=lambda f: say(
                f"  {f.readers} reader(s) {f.nbytes >> 20:>4} MiB {f.transport:14} {f.message.median_ms:8.2f} ms/msg "
                f"(spread {f.message.spread:.0%}, n={f.message.n}, {f.gib_per_s:.2f} GiB/s, {f.ratio_to_memcpy:.1f} x memcpy"
                + (f", {f.ratio.median:.2f} x arena upstream [{f.ratio.low:.2f}-{f.ratio.high:.2f}]" if f.ratio else "")
                + ")"))
    if "channel" in parts:
        say("channel: compiled graph over two Ray nodes, none/detach/lists")
        results["channel"] = channel.run(quick=args.quick, note=lambda n: (notes.append(n), say(n)), progress=lambda f: say(
            f"  {f.num_reqs:5} reqs {f.variant:7} {f.step.median_ms:8.3f} ms/step (spread {f.step.spread:.0%}"
            + (f", {f.vs_none:.2f} x none" if f.vs_none is not None and f.variant != "none" else "") + ")"))
        say("channel: the detach alone on one output of 2048 requests per field shape, per mode, beside memcpy")
        results["detach"] = detach.run(quick=args.quick, progress=lambda f: say(
            f"  {f.shape:16} {f.variant:8} {f.detach.median_ms:8.4f} ms (spread {f.detach.spread:.0%})"
            + (f", {f.ratio.median:.2f} x upstream" if f.ratio else "")))
    if "pipeline" in parts:
        say(f"pipeline: PP=2 x TP=2 compiled graph, {pipeline.STAGE_MS:g} ms of device time per stage, "
            f"vLLM's in-flight count per inflight mode")
        results["pipeline"] = pipeline.run(quick=args.quick, note=lambda n: (notes.append(n), say(n)),
                                           progress=lambda f: say(
            f"  {f.mode:8} {f.inflight} in flight {f.execution.median_ms:7.2f} ms/execution "
            f"(spread {f.execution.spread:.0%}" + (f", {f.vs_upstream:.2f} x upstream" if f.mode != "upstream"
                                                   and f.vs_upstream is not None else "") + ")"))
    if "e2e" in parts:
        say("e2e: single-process reference (not with --quick), then the cluster per mode")
        results["e2e"] = e2e.run(quick=args.quick, note=lambda n: (notes.append(n), say(n)), progress=lambda f: say(
            f"  {f.server:16} {f.workload:14} total p50 {f.total_p50:.3f} s p95 {f.total_p95:.3f} s "
            f"TTFT p50 {f.ttft_p50:.3f} s {f.tokens_per_s:.1f} tok/s"))
    if "inflight" in parts:
        say("inflight: compiled graph, PP executions in flight (upstream) vs one (testbed), no logprobs")
        results["e2e"] += e2e.run_inflight(quick=args.quick, note=lambda n: (notes.append(n), say(n)),
                                           progress=lambda f: say(
            f"  {f.server:16} {f.workload:20} total p50 {f.total_p50:.3f} s p95 {f.total_p95:.3f} s "
            f"{f.tokens_per_s:.1f} tok/s"))
    meta = {"vllm": running(), "quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores", "notes": notes,
            "seconds": round(time.monotonic() - start, 1)}
    written = report.write(out, meta=meta, **results)
    print((out / "bench.md").read_text())
    say(f"written: {', '.join(str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else str(p) for p in written)}")


if __name__ == "__main__":
    main()
