"""A soak's report: ``soak.json`` (everything), ``soak.md`` (verdicts, growth table, latency per
minute), ``soak.png`` (each figure over time per node, p50/p99 per minute) and ``junit.xml``
(one test case per check and per budgeted figure, for CI)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from vllm_zerocopy_testbed.vllm_source import vllm_line
from vllm_zerocopy_testbed.soak import analysis
from vllm_zerocopy_testbed.soak.analysis import Growth, Minute, Sample, Verdicts
from vllm_zerocopy_testbed.workload.requests import Record

PLOTTED = ("rss_mb", "heap_in_use_mb", "heap_free_mb", "fds", "shm_mb", "shm_files", "object_store_mb")


def growth_table(rates: list[Growth]) -> str:
    lines = ["| node | figure | first | last | growth per hour | at least (95%) | of it known | budget (for the rest, "
             "at least) | |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rates:
        unit = analysis.UNITS[r.metric]
        budgeted = r.budget != float("inf")
        known = f"{r.known:+.2f} ({r.known_as})" if r.known else ""
        low = f"{r.lower:+.2f}"
        lines.append(f"| {r.node} | {r.metric} | {r.first:.1f} | {r.last:.1f} | {r.per_hour:+.2f} {unit} | {low} | {known} | "
                     + (f"{r.budget:g} {unit} | {'pass' if r.ok else '**FAIL**'} |" if budgeted else "none | |"))
    return "\n".join(lines)


def process_table(rates: list[Growth], top: int = 8, heap: dict[str, list[Growth]] | None = None) -> str:
    """The largest processes' RSS growth; with heap probes, beside it their heap in use and kept."""
    heap = {k: {(g.node, g.metric): g for g in v} for k, v in (heap or {}).items()}
    columns = [k for k in ("heap_in_use_mb", "heap_free_mb") if heap.get(k)]
    titles = {"heap_in_use_mb": "heap in use", "heap_free_mb": "heap freed, kept"}
    lines = ["| node | process | first | last | RSS growth per hour |" + "".join(f" {titles[c]} per hour |" for c in columns),
             "|---|---|---|---|---|" + "---|" * len(columns)]
    for r in rates[:top]:
        cells = []
        for column in columns:
            found = heap[column].get((r.node, r.metric))
            cells.append(f" {found.per_hour:+.1f} MB |" if found else " - |")
        lines.append(f"| {r.node} | {r.metric} | {r.first:.0f} MB | {r.last:.0f} MB | {r.per_hour:+.1f} MB |" + "".join(cells))
    return "\n".join(lines)


def minutes_table(minutes: list[Minute]) -> str:
    lines = ["| minute | requests | failed | p50 | p99 |", "|---|---|---|---|---|"]
    lines += [f"| {m.minute} | {m.requests} | {m.failed} | {m.p50_s:.2f} s | {m.p99_s:.2f} s |" for m in minutes]
    return "\n".join(lines)


def markdown(meta: dict[str, Any], records: list[Record], rates: list[Growth], minutes: list[Minute],
             verdicts: Verdicts, sample_errors: list[str], processes: list[Growth] = (),
             explaining: list[Growth] = (), process_heap: dict[str, list[Growth]] | None = None,
             diagnosis: list[str] = (), known: list[str] = ()) -> str:
    failed = sum(not r.ok for r in records)
    head = [f"# Soak ({meta['duration_s'] / 60:g} min judged past a {meta['warmup_s'] / 60:g} min warm-up, "
            f"{meta['clients']} clients, {meta['cluster']})", "",
            f"Started {meta['started']}; modes: {', '.join(meta['modes']) or 'not logged'}; "
            f"{meta['distinct_requests']} distinct requests; "
            f"vLLM under test: {vllm_line(meta['vllm']) if meta.get('vllm') else '?'}; "
            f"node environment: {meta.get('node_env') or 'none added'}; each node sampled every {meta['sample_s']:.0f} s; "
            f"growth fitted past the first {meta['warmup_s']:.0f} s (Theil-Sen slope; a figure fails when the "
            "lower 95% bound of its slope, less the known growth, passes its budget).", "",
            f"**{'PASS' if verdicts.ok else 'FAIL'}**: {len(records)} requests, {failed} failed.", ""]
    checks = [f"- {v.checker}: {'ok' if v.ok else 'FAIL'}" + _figures(v.figures)
              + ("".join(f"\n  - {p}" for p in v.problems[:10])) for v in verdicts.items]
    if meta.get("not_bit_identical"):
        checks.append(f"- answers that were not bit-identical to their first (within the tolerance): "
                      f"{', '.join(meta['not_bit_identical'])}")
    errors = ["", "Samples that failed:", *(f"- {e}" for e in sample_errors[:10])] if sample_errors else []
    where = (["", "Where RSS grows (the largest processes per node, no budget):", "",
              process_table(list(processes), heap=process_heap)] if processes else [])
    what = ["", "What the RSS growth is (vLLM processes' heap probes, observe/heap.py):", "",
            *(f"- {line}" for line in diagnosis)] if diagnosis else []
    known_lines = (["", "Known growth (judged without it; its signature and what it accounts for):", "",
                    *(f"- {line}" for line in known)] if known else [])
    return "\n".join([*head, *checks, *errors, "", "## Growth", "", growth_table([*rates, *explaining]), *known_lines,
                      *what,
                      *where, "",
                      "## Latency per minute", "", minutes_table(minutes), ""])


def _figures(figures: dict[str, float]) -> str:
    return f" ({', '.join(f'{k} {v:g}' for k, v in figures.items())})" if figures else ""


def junit(verdicts: Verdicts, rates: list[Growth], seconds: float) -> ET.ElementTree:
    cases = [(v.checker, None if v.ok else "\n".join(v.problems)) for v in verdicts.items]
    cases += [(f"growth {r.node} {r.metric}", None if r.ok else
               f"{r.per_hour:.2f} {analysis.UNITS[r.metric]}/hour"
               + (f" ({r.known:.2f} known: {r.known_as})" if r.known else "") + f", budget {r.budget:g}")
              for r in rates]
    suite = ET.Element("testsuite", name="soak", tests=str(len(cases)), failures=str(sum(m is not None for _, m in cases)),
                       time=f"{seconds:.1f}")
    for name, message in cases:
        case = ET.SubElement(suite, "testcase", classname="soak", name=name)
        if message is not None:
            ET.SubElement(case, "failure", message=message.splitlines()[0][:200]).text = message
    return ET.ElementTree(suite)


def plot(path: Path, samples: list[Sample], minutes: list[Minute]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PLOTTED) + 1, 1, figsize=(9, 2.2 * (len(PLOTTED) + 1)), sharex=True)
    nodes = sorted({s.node for s in samples})
    for ax, metric in zip(axes, PLOTTED):
        for node in nodes:
            points = [(s.at / 60, s.figures[metric]) for s in samples if s.node == node and metric in s.figures]
            if points:
                ax.plot(*zip(*points), marker=".", label=node)
        ax.set_ylabel(f"{metric}\n({analysis.UNITS[metric]})", fontsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    if minutes:
        ax.plot([m.minute + 0.5 for m in minutes], [m.p50_s for m in minutes], marker=".", label="p50")
        ax.plot([m.minute + 0.5 for m in minutes], [m.p99_s for m in minutes], marker=".", label="p99")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("latency (s)", fontsize=8)
    ax.set_xlabel("minutes")
    ax.grid(alpha=0.3)
    fig.suptitle("make soak: per node, over time")
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # the title above the first plot, not over it
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(out: Path, meta: dict[str, Any], records: list[Record], samples: list[Sample], began: float,
          warmup_s: float, verdicts: Verdicts) -> list[Path]:
    """Write the four files into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rates = analysis.growth(samples, warmup_s)
    processes = analysis.process_growth(samples, warmup_s)
    explaining = analysis.growth(samples, warmup_s, analysis.EXPLAINING)
    process_heap = {k: analysis.process_growth(samples, warmup_s, prefix=f"{k}/")
                    for k in ("heap_in_use_mb", "heap_free_mb", "context_vars")}
    diagnosis = analysis.where_rss_goes(rates, explaining)
    known = analysis.known_growth(samples, warmup_s)
    minutes = analysis.per_minute(records, began)
    errors = [f"{s.at:.0f} s {s.node}: {s.error}" for s in samples if s.error]
    data = {"meta": meta, "ok": verdicts.ok,
            "verdicts": [{"checker": v.checker, "ok": v.ok, "problems": v.problems, "figures": v.figures}
                         for v in verdicts.items],
            "growth": [r.to_json() for r in rates],
            "process_growth": [{**r.to_json(), "budget_per_hour": None, "ok": None} for r in processes],
            "explaining_growth": [{**r.to_json(), "budget_per_hour": None, "ok": None} for r in explaining],
            "process_heap_growth": {k: [{**r.to_json(), "budget_per_hour": None, "ok": None} for r in v]
                                    for k, v in process_heap.items()},
            "where_rss_goes": diagnosis,
            "known_growth": known,
            "minutes": [m.to_json() for m in minutes],
            "samples": [s.to_json() for s in samples],
            "requests": {"total": len(records), "failed": sum(not r.ok for r in records)}}
    paths = [out / "soak.json", out / "soak.md", out / "junit.xml"]
    paths[0].write_text(json.dumps(data, indent=1))
    paths[1].write_text(markdown(meta, records, rates, minutes, verdicts, errors, processes, explaining, process_heap,
                                 diagnosis, known))
    junit(verdicts, rates, meta["duration_s"]).write(paths[2], encoding="unicode", xml_declaration=False)
    paths.append(plot(out / "soak.png", samples, minutes))
    return paths
