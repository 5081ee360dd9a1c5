"""The out-of-band buffer timeline (``patches/timeline.py``), per buffer kind: did a write overlap a send?

For every large frame handed to ZMQ: how long ZMQ held it (hand-off to release), and
the gap from its release to the next write into the same memory (a hooked fill of a
persistent buffer, or a later send of the same memory whose CRC differs). A negative gap is the race of
upstream PR 53217: the engine wrote the bytes while ZMQ could still be sending them.
Readers' CRCs that differ from the writer's at hand-off are the race reaching a reader.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.patches.timeline import TIMELINE_PREFIX

_LINE = re.compile(rf"{TIMELINE_PREFIX} (\{{.*?\}})\s*$", re.MULTILINE)


def events(logs: str) -> list[dict[str, Any]]:
    """Return every timeline event found in ``logs`` (log prefixes and other lines ignored)."""
    found = []
    for match in _LINE.finditer(logs):
        try:
            found.append(json.loads(match.group(1)))
        except json.JSONDecodeError:
            continue  # a line cut by the log driver
    return found


@dataclass
class KindFigures:
    """What the timeline says about one kind of out-of-band buffer."""

    kind: str
    sent: int = 0
    released: int = 0
    held_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)  # next write minus release (< 0: overlap)
    overlaps: int = 0  # written again before ZMQ released it
    received: int = 0
    corrupt: int = 0  # a reader's CRC differs from the writer's at hand-off

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "sent": self.sent, "released": self.released,
            "held_ms_p50": _round(statistics.median(self.held_ms)) if self.held_ms else None,
            "held_ms_max": _round(max(self.held_ms)) if self.held_ms else None,
            "rewritten": len(self.gaps_ms),
            "min_gap_ms": _round(min(self.gaps_ms)) if self.gaps_ms else None,
            "overlaps": self.overlaps, "received": self.received, "corrupt": self.corrupt,
        }


def _round(value: float) -> float:
    return round(value, 3)


def _key(event: dict[str, Any]) -> tuple[int, int, int]:
    return (event["port"], event["seq"], event["frame"])


def summarize(found: list[dict[str, Any]]) -> dict[str, KindFigures]:
    """Return per buffer kind (the RPC a frame belonged to) the timeline's figures."""
    sends = {(e["pid"], *_key(e)): e for e in found if e.get("ev") == "send"}
    releases = {(e["pid"], *_key(e)): e["t"] for e in found if e.get("ev") == "release"}
    # Writes into memory: hooked fills, and a later send of the same memory with other bytes
    # (it was written by then). A send of unchanged bytes is no write: one message goes out
    # on the overflow socket and on the remote socket, the same memory twice.
    writes = [(e["pid"], e["t"], e["addr"], e["addr"] + e["nbytes"]) for e in found if e.get("ev") == "write"]
    previous: dict[tuple[int, int, int], int] = {}  # (pid, addr, nbytes) -> CRC at the last hand-off
    for send in sorted(sends.values(), key=lambda e: e["t"]):
        memory = (send["pid"], send["addr"], send["nbytes"])
        if memory in previous and previous[memory] != send["crc"]:
            writes.append((send["pid"], send["t"], send["addr"], send["addr"] + send["nbytes"]))
        previous[memory] = send["crc"]
    writes.sort(key=lambda w: w[1])
    by_kind: dict[str, KindFigures] = {}
    for key, send in sends.items():
        figures = by_kind.setdefault(send["kind"], KindFigures(send["kind"]))
        figures.sent += 1
        released = releases.get(key)
        if released is not None:
            figures.released += 1
            figures.held_ms.append((released - send["t"]) * 1e3)
        start, end = send["addr"], send["addr"] + send["nbytes"]
        later = next((w for w in writes if w[0] == send["pid"] and w[1] > send["t"] and w[2] < end and w[3] > start),
                     None)
        if later is None:
            continue
        if released is None:  # written again and never seen released: an overlap
            figures.overlaps += 1
            continue
        gap = (later[1] - released) * 1e3
        figures.gaps_ms.append(gap)
        figures.overlaps += gap < 0
    # Readers: a CRC per frame received, matched to the send with the same port, seq, frame.
    crc_at_send = {_key(s): (s["crc"], s["kind"]) for s in sends.values()}
    for event in found:
        if event.get("ev") != "recv" or _key(event) not in crc_at_send:
            continue
        crc, kind = crc_at_send[_key(event)]
        figures = by_kind.setdefault(kind, KindFigures(kind))
        figures.received += 1
        figures.corrupt += event["crc"] != crc
    return by_kind


def check_no_overlap(logs: str, *, need_kind: str | None = None) -> Verdict:
    """Fail where an out-of-band buffer was written again before ZMQ released it, or a reader got other bytes.

    ``need_kind``: also fail unless frames of that kind were sent and seen released (the
    workload reached the path at all).
    """
    verdict = Verdict("out-of-band buffers never rewritten in flight")
    summary = summarize(events(logs))
    for kind, figures in sorted(summary.items()):
        row = figures.as_dict()
        for name in ("sent", "overlaps", "corrupt"):
            verdict.figures[f"{kind}.{name}"] = row[name]
        if row["min_gap_ms"] is not None:
            verdict.figures[f"{kind}.min_gap_ms"] = row["min_gap_ms"]
        if figures.overlaps:
            verdict.fail(f"{kind}: {figures.overlaps} of {figures.sent} frames written again while ZMQ held them "
                         f"(smallest gap {row['min_gap_ms']} ms)")
        if figures.corrupt:
            verdict.fail(f"{kind}: {figures.corrupt} of {figures.received} frames reached a reader with other bytes "
                         "than were handed to ZMQ (upstream PR 53217)")
    if need_kind and not summary.get(need_kind, KindFigures(need_kind)).released:
        verdict.fail(f"no out-of-band {need_kind} frame was sent and released (is TESTBED_MQ_TIMELINE=1 set, "
                     "and is the message >= 1 MiB?)")
    return verdict


def describe(figures: KindFigures) -> str:
    """One line of figures for a report: frames, hold, smallest gap, overlaps, changed at readers."""
    row = figures.as_dict()
    return (f"{row['kind']}: {row['sent']} out-of-band frames (>= 1 MiB), held by ZMQ p50 {row['held_ms_p50']} ms / "
            f"max {row['held_ms_max']} ms, smallest gap from release to the next write {row['min_gap_ms']} ms, "
            f"{row['overlaps']} written while held, {row['corrupt']} of {row['received']} changed at readers")


def table(summary: dict[str, KindFigures]) -> str:
    """Return the summary as a Markdown table, one row per buffer kind."""
    columns = ["kind", "sent", "released", "held_ms_p50", "held_ms_max", "rewritten", "min_gap_ms", "overlaps",
               "received", "corrupt"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for figures in sorted(summary.values(), key=lambda f: f.kind):
        row = figures.as_dict()
        lines.append("| " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def path_figures(logs: str, path: str = "remote") -> dict[str, float]:
    """What the writer sent on ``path`` (``remote``: to the TCP readers of another node), from its
    ``send`` and ``release`` events: ``largest_bytes`` (the most out-of-band bytes one message
    carried), ``frames``, ``unreleased`` (frames ZMQ never let go of while the writer lived) and
    ``held_ms_max`` (the longest hand-off to release)."""
    found = events(logs)
    releases = {(e.get("pid"), *_key(e)): e["t"] for e in found if e.get("ev") == "release"}
    sizes: dict[tuple[Any, Any, Any], int] = {}
    frames, unreleased, held = 0, 0, [0.0]
    for event in found:
        if event.get("ev") != "send" or event.get("path") != path:
            continue
        message = (event.get("pid"), event.get("port"), event.get("seq"))
        sizes[message] = sizes.get(message, 0) + int(event.get("nbytes", 0))
        frames += 1
        released = releases.get((event.get("pid"), *_key(event)))
        if released is None:
            unreleased += 1
        else:
            held.append((released - event["t"]) * 1e3)
    return {"largest_bytes": float(max(sizes.values(), default=0)), "frames": float(frames),
            "unreleased": float(unreleased), "held_ms_max": _round(max(held))}
