"""Speed: the broadcast micro-benchmark, base and candidate taking turns round by round in one run.

One long-lived process per side (``speed_child``, under its overlay) holds a real ``MessageQueue``
and its readers; the parent drives them in turns and stops the idle side's whole process group
(SIGSTOP), so each turn has the machine to itself. A round is one turn per side, their order
rotated every round; a turn's figure is the median of a few messages (enqueue until the reader
had the tensor rebuilt, as ``bench/broadcast.py`` measures). Per cell (path, size):
candidate / base round by round with its 95% interval (``stats.paired``) beside the base against
itself (``stats.self_ratio``, the A/A noise).

A regression is BROKE (speed) when candidate / base is above ``1 + THRESHOLD``, its interval's
low end above 1, and the ratio beyond the A/A noise's high end; a gain the mirror image.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vllm_zerocopy_testbed.bench.stats import Ratio, paired, sample, self_ratio
from vllm_zerocopy_testbed.check.resolve import Side
from vllm_zerocopy_testbed.check.side import side_env
from vllm_zerocopy_testbed.check.speed_child import REPLY_FD_ENV
from vllm_zerocopy_testbed.cluster.process import kill_session
from vllm_zerocopy_testbed.config import REPO_ROOT

KiB, MiB = 1 << 10, 1 << 20
THRESHOLD = 0.10  # candidate / base above 1.10 (interval and noise permitting): BROKE (speed)
SIZES = (64 * KiB, 1 * MiB, 8 * MiB)
# (path label, speed_child topology, sizes): local and remote readers, and the arena where both sides have it
CELLS = (("broadcast local", "local-1", SIZES), ("broadcast remote", "remote-1", SIZES),
         ("arena", "arena-1", (8 * MiB, 32 * MiB)))
# vLLM's Ray output detach alone, on one output of 2048 requests per field shape (bench/detach.py's)
DETACH_SHAPES = ("logprobs",)
# A turn: at least PER_TURN messages and TURN_S seconds of them, its figure their median. 32 rounds give the
# A/A noise 16 pairs: fewer and its 95% interval is its smallest and largest ratio.
ROUNDS, MIN_ROUNDS = 32, 16
PER_TURN, TURN_S, WARM = 5, 0.025, 1
CELL_BUDGET_S = 10.0
READER_TIMEOUT_S = 900.0  # a stopped side's readers wait this long for their next message
REPLY_TIMEOUT_S = 180.0

SLOWER, FASTER, SAME_SPEED = "BROKE (speed)", "faster", "same"
AGAIN = "base-again"  # a second process of the base: the noise of a cell where processes differ (the detach)
# Slower on a path where the candidate FIXED a property and BROKE none: the fix's price, shown and not red (a
# fix is good news; what it costs is the reviewer's call). Slower anywhere else is BROKE (speed): also on a
# path where the change fixed one property and broke another, which is a different change than a fix.
FIX_COST = "cost of the fix"


def row_path(cell_path: str) -> str:
    """The verdict table's path of a speed cell (``broadcast remote`` -> ``broadcast``)."""
    return cell_path.split()[0]


def charge_fixes(cells: list["SpeedCell"], fixed_paths: set[str], broken_paths: frozenset[str] = frozenset()) -> None:
    """Turn BROKE (speed) into the cost of the fix where the candidate FIXED a property on that path and broke
    none there."""
    for cell in cells:
        path = row_path(cell.path)
        if cell.verdict == SLOWER and path in fixed_paths and path not in broken_paths:
            cell.verdict = FIX_COST


@dataclass
class SpeedCell:
    """One path and size: each side's median per message, candidate / base, the noise, the verdict."""

    path: str
    nbytes: int
    base_ms: float
    candidate_ms: float
    ratio: Ratio
    noise: Ratio | None
    verdict: str
    base_enqueue_ms: float = 0.0
    candidate_enqueue_ms: float = 0.0
    rounds: int = 0
    shape: str = ""  # the detach's output shape (its cells have no size)

    @property
    def size(self) -> str:
        return self.shape or _size(self.nbytes)


@dataclass
class SpeedRun:
    cells: list[SpeedCell] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    skipped: list[str] = field(default_factory=list)  # paths not measured, and why
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)


def speed_verdict(ratio: Ratio, noise: Ratio | None, threshold: float = THRESHOLD) -> str:
    """BROKE (speed), faster or same: beyond the threshold, with the interval clear of 1, beyond the noise."""
    if ratio.median > 1 + threshold and ratio.low > 1 and (noise is None or ratio.median > noise.high):
        return SLOWER
    if ratio.median < 1 - threshold and ratio.high < 1 and (noise is None or ratio.median < noise.low):
        return FASTER
    return SAME_SPEED


class SpeedError(RuntimeError):
    """A benchmark process failed or did not answer: the testbed's error, said with the side."""


class Child:
    """One side's ``speed_child`` process, in a session (and process group) of its own."""

    def __init__(self, side: Side, log: Path, rpc_dir: str) -> None:
        self.side = side
        read, write = os.pipe()
        # vLLM binds its readers' ZMQ IPC sockets under VLLM_RPC_BASE_PATH (/tmp by default) and leaves
        # them when its process is ended: every check left four there. A folder of the run's, removed.
        env = {**side_env(side), REPLY_FD_ENV: str(write), "VLLM_RPC_BASE_PATH": rpc_dir}
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_zerocopy_testbed.check.speed_child"],
                                     cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=(write,), start_new_session=True,
                                     text=True)
        os.close(write)
        self._reply = os.fdopen(read, "r")
        self._buffer = ""
        self.stopped = False

    def ask(self, cmd: dict, timeout: float = REPLY_TIMEOUT_S) -> dict:
        self.send(cmd)
        return self.receive(timeout, cmd["op"])

    def send(self, cmd: dict) -> None:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise SpeedError(f"{self.side.label}: the benchmark process is gone (exit {self.proc.poll()}): {exc}; "
                             f"see {self._log.name}") from None

    def receive(self, timeout: float, op: str) -> dict:
        deadline = time.monotonic() + timeout
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._reply], [], [], max(0.0, left))
            if not ready:
                raise SpeedError(f"{self.side.label}: no answer to {op} within {timeout:.0f} s")
            chunk = os.read(self._reply.fileno(), 65536).decode()
            if not chunk:
                raise SpeedError(f"{self.side.label}: the benchmark process ended (exit {self.proc.poll()}); "
                                 f"see {self._log.name}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition("\n")
        answer = json.loads(line)
        if "error" in answer:
            raise SpeedError(f"{self.side.label}: {op} failed: {answer['error']}")
        return answer

    def pause(self) -> None:
        if not self.stopped and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.stopped and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def close(self) -> int:
        """End the process (and anything of its session); return its peak RSS in bytes (0: unknown)."""
        rss = 0
        try:
            if self.proc.poll() is None:
                rss = int(self.ask({"op": "exit"}, timeout=60).get("maxrss_bytes", 0))
                self.proc.wait(timeout=30)
        except (SpeedError, subprocess.TimeoutExpired, OSError, ValueError):
            pass
        finally:
            self.resume()
            kill_session(self.proc.pid)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self._reply.close()
            self._log.close()
        return rss


def run(base: Side, candidate: Side, out: Path, say: Callable[[str], None]) -> SpeedRun:
    """Measure every cell, the sides taking turns; the idle one stopped."""
    start = time.monotonic()
    result = SpeedRun()
    cells = []
    for path, topology, sizes in CELLS:
        lacking = [s.label for s in (base, candidate) if topology == "arena-1" and "tensor arena" in s.lacks]
        if lacking:
            result.skipped.append(f"{path}: the {' and the '.join(lacking)} has no tensor arena")
            continue
        cells.append((path, topology, sizes))
    rpc_dir = tempfile.mkdtemp(prefix="testbed-ipc-check-")
    children: dict[str, Child] = {}
    try:
        children["base"] = Child(base, out / "speed-base.log", rpc_dir)
        children["candidate"] = Child(candidate, out / "speed-candidate.log", rpc_dir)
        for path, topology, sizes in cells:
            for child in children.values():  # both start their readers at once: start-up is not measured
                child.send({"op": "open", "topology": topology, "timeout": READER_TIMEOUT_S})
            for child in children.values():
                child.receive(timeout=300, op="open")
                child.pause()
            for nbytes in sizes:
                cell = _measure_cell(children, path, nbytes, {"op": "measure", "nbytes": nbytes, "warm": WARM})
                result.cells.append(cell)
                _say_cell(say, cell)
        lacking = [s.label for s in (base, candidate) if "Ray output detach" in s.lacks]
        if lacking:
            result.skipped.append(f"detach: the {' and the '.join(lacking)} has no Ray output detach")
        else:
            # The detach takes ~25 us a call: one process runs it several percent faster or slower than
            # another of the same code (an unchanged detach read x0.81-x1.11 in different checks, where
            # one process against itself varied less). Its noise is therefore a second base process
            # against the first, in fresh processes taking turns with the candidate's.
            children = _fresh(children, base, candidate, out, result, rpc_dir)
            for shape in DETACH_SHAPES:
                cell = _measure_cell(children, "detach", 0, {"op": "detach", "shape": shape})
                cell.shape = shape
                result.cells.append(cell)
                _say_cell(say, cell)
    except SpeedError as exc:
        result.error = str(exc)
    finally:
        _close(children, result)
        shutil.rmtree(rpc_dir, ignore_errors=True)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def _fresh(children: dict[str, Child], base: Side, candidate: Side, out: Path, result: SpeedRun,
           rpc_dir: str) -> dict[str, Child]:
    """End both sides' benchmark processes (their peak RSS kept) and start a new one each, and a second
    one of the base (``AGAIN``): the noise between two processes of the same code."""
    _close(children, result)
    children["base"] = Child(base, out / "speed-base-detach.log", rpc_dir)
    children["candidate"] = Child(candidate, out / "speed-candidate-detach.log", rpc_dir)
    children[AGAIN] = Child(base, out / "speed-base-again-detach.log", rpc_dir)
    for child in children.values():  # both import and build their outputs at once: not measured
        child.send({"op": "detach", "shape": DETACH_SHAPES[0], "count": 1, "min_s": 0.0})
    for child in children.values():
        child.receive(timeout=300, op="detach")
        child.pause()
    return children


def _say_cell(say: Callable[[str], None], cell: SpeedCell) -> None:
    say(f"  {cell.path:16} {cell.size:>8}: base {cell.base_ms:8.3f} ms, candidate {cell.candidate_ms:8.3f} ms, "
        f"x{cell.ratio.median:.2f} [{cell.ratio.low:.2f}-{cell.ratio.high:.2f}]"
        + (f", A/A [{cell.noise.low:.2f}-{cell.noise.high:.2f}]" if cell.noise else "")
        + f": {'slower' if cell.verdict == SLOWER else cell.verdict}")  # judged once every row is known


def _close(children: dict[str, Child], result: SpeedRun) -> None:
    """End every process in ``children`` and empty it (never a process closed twice); each side keeps
    the largest peak RSS of its processes."""
    for label, child in children.items():
        result.peak_rss_bytes[_side(label)] = max(result.peak_rss_bytes.get(_side(label), 0), child.close())
    children.clear()


def _both_ways(noise: Ratio) -> Ratio:
    """Two processes of the same code, as a noise band either way: which of them is the faster one is
    chance, so a second process x0.87 of the first says a candidate's process may read x0.87 or x1.15."""
    low, high = min(noise.low, 1 / noise.high), max(noise.high, 1 / noise.low)
    return Ratio(noise.median, noise.spread, low, high, noise.n)


def _side(label: str) -> str:
    return "base" if label == AGAIN else label


def _measure_cell(children: dict[str, Child], path: str, nbytes: int, op: dict) -> SpeedCell:
    """Every process takes turns (the first rotated each round); the noise is the base against itself a
    round later, or, where a second base process runs (``AGAIN``), that process against the first."""
    order = list(children)
    values: dict[str, list[float]] = {label: [] for label in order}
    held: dict[str, list[float]] = {label: [] for label in order}
    started = time.monotonic()
    for i in range(ROUNDS):
        for label in order[i % len(order):] + order[:i % len(order)]:
            child = children[label]
            answer = child.ask({**op, "count": PER_TURN, "min_s": TURN_S})
            child.pause()
            values[label].append(sample(answer["times"]).median_ms)
            held[label].append(sample(answer["enqueue"]).median_ms)
        if i + 1 >= MIN_ROUNDS and time.monotonic() - started > CELL_BUDGET_S:
            break
    ratio = paired(values["candidate"], values["base"])
    noise = _both_ways(paired(values[AGAIN], values["base"])) if AGAIN in values else \
        self_ratio(values["base"], period=2)
    return SpeedCell(path, nbytes, sample(values["base"]).median_ms, sample(values["candidate"]).median_ms, ratio,
                     noise, speed_verdict(ratio, noise), sample(held["base"]).median_ms,
                     sample(held["candidate"]).median_ms, len(values["base"]))


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
