"""What each broadcast mode costs per message, beside a memcpy of the same bytes.

One writer (this process) and one reader process, through the real
``MessageQueue``: a local reader over the shared-memory ring (or its overflow
socket when the message exceeds a chunk) and a remote reader over TCP on
127.0.0.2. Per message: from ``enqueue`` until the reader has rebuilt it, and
how long ``enqueue`` itself held the writer. Medians and spread over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_zerocopy_testbed.config import PatchMode
from vllm_zerocopy_testbed.harness.message_queue import MessageQueueHarness, QueueTopology

MiB = 1 << 20
PATHS = {
    "local": QueueTopology(local_readers=1),  # ring up to 24 MiB chunks, overflow above
    "remote-tcp": QueueTopology(local_readers=0, remote_readers=1),
}


@dataclass(frozen=True)
class Figure:
    """One (path, size, mode) cell: medians in ms and spread as IQR / median."""

    path: str
    mib: int
    mode: str
    message_ms: float
    enqueue_ms: float
    memcpy_ms: float
    spread: float

    @property
    def ratio_to_memcpy(self) -> float:
        return self.message_ms / self.memcpy_ms


def _iqr_ratio(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def memcpy_ms(nbytes: int, repeats: int) -> float:
    """Median time of copying ``nbytes`` between two pre-touched buffers."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(path: str, mib: int, mode: PatchMode, repeats: int, baseline: float) -> Figure:
    tensor = torch.randn(mib * MiB // 4)
    message, held = [], []
    with MessageQueueHarness(PATHS[path], mode, ack_only=True) as harness:
        for i in range(repeats + 2):  # two warm-up messages
            start = time.perf_counter()
            harness.send({"prompt_embeds": tensor})
            sent = time.perf_counter()
            harness.collect()
            if i >= 2:
                message.append((time.perf_counter() - start) * 1e3)
                held.append((sent - start) * 1e3)
    return Figure(path, mib, mode.value, statistics.median(message), statistics.median(held),
                  baseline, _iqr_ratio(message))


def to_markdown(figures: list[Figure]) -> str:
    lines = ["| path | MiB | mode | per message (ms) | enqueue held (ms) | memcpy (ms) | x memcpy | spread |",
             "|---|---|---|---|---|---|---|---|"]
    for f in figures:
        flag = " (>5%)" if f.spread > 0.05 else ""
        lines.append(f"| {f.path} | {f.mib} | {f.mode} | {f.message_ms:.2f} | {f.enqueue_ms:.2f} | "
                     f"{f.memcpy_ms:.2f} | {f.ratio_to_memcpy:.1f} | {f.spread:.0%}{flag} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,4,16,64", help="MiB, comma-separated")
    parser.add_argument("--modes", default="upstream,testbed,off")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("reports") / f"bench-broadcast-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args(argv)
    figures = []
    for path in args.paths.split(","):
        for mib in (int(s) for s in args.sizes.split(",")):
            baseline = memcpy_ms(mib * MiB, args.repeats)
            for mode in args.modes.split(","):
                figure = measure(path, mib, PatchMode(mode), args.repeats, baseline)
                figures.append(figure)
                print(f"{path:10} {mib:4} MiB {mode:9} {figure.message_ms:8.2f} ms/msg "
                      f"(enqueue {figure.enqueue_ms:.2f} ms, memcpy {baseline:.2f} ms, spread {figure.spread:.0%})",
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "broadcast.json").write_text(json.dumps([asdict(f) for f in figures], indent=1))
    (args.out / "broadcast.md").write_text(to_markdown(figures) + "\n")
    print(to_markdown(figures))
    print(f"written: {args.out}/broadcast.json, broadcast.md")


if __name__ == "__main__":
    main()
