"""Where vLLM's ranks run and which modes each process has, read from server logs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from vllm_zerocopy_testbed.config import ConfigError
from vllm_zerocopy_testbed.model import IMAGE_MODELS

# Every rank logs "world_size=W rank=R local_rank=L ..." (the "is assigned as" line only
# on local rank 0); Ray prefixes a worker's lines with "(Actor pid=N, ip=IP)", leaving the
# IP out for workers on the driver's own node.
_RANK_LINE = re.compile(r"\(\w+ pid=\d+(?:, ip=(?P<ip>[\d.]+))?\).*?world_size=\d+ rank=(?P<rank>\d+) local_rank=")
# vLLM's own prefix names the worker process: "(Worker pid=N)" or "(Worker_PP1_TP0 pid=N)".
_VLLM_RANK_LINE = re.compile(r"\(Worker\S* pid=(?P<pid>\d+)\).*?world_size=\d+ rank=(?P<rank>\d+) local_rank=")
_WORKER_NODE_LINE = re.compile(r"testbed modes pid=(?P<pid>\d+) role=ray-worker .*? node=(?P<ip>[\d.]+)")
# Our communicator's own line (plugins/host_aware_communicator.py), for every executor.
_TESTBED_RANK_LINE = re.compile(r"testbed rank pid=\d+ rank=(?P<rank>\d+) node=(?P<ip>[\d.]+)")
_MODES_LINE = re.compile(r"testbed modes pid=\d+ role=\S+ broadcast=\S+ detach=\S+")


@dataclass(frozen=True)
class RankPlacement:
    """Where one vLLM worker rank runs."""

    rank: int
    ip: str
    node: str
    pp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class Topology:
    """PP x TP vLLM ranks over the head and ``workers`` worker nodes of ``slots`` devices each.

    vLLM asks Ray for one device per rank in a PACK placement group whose first bundle is on the
    engine's node (the head), then numbers the ranks node by node, the head's first: each node's
    devices take the next ``slots`` ranks, TP innermost. With TP = slots, every node holds one PP
    stage and every stage boundary crosses nodes (the transport under test).
    """

    pp: int
    tp: int
    workers: int
    slots: int  # TESTBED_HPU_PER_NODE (cpu) or TESTBED_GPUS_PER_NODE (gpu)
    layers: int | None = None  # the model's hidden layers, where known

    @classmethod
    def from_settings(cls, values: Mapping[str, str]) -> "Topology":
        """The topology the cluster settings ask for (``ConfigError``, naming the knob, for a non-number)."""
        slots_key = "TESTBED_GPUS_PER_NODE" if values.get("TESTBED_PROFILE", "cpu") == "gpu" else "TESTBED_HPU_PER_NODE"
        numbers: dict[str, int] = {}
        for key, least in (("TESTBED_PP", 1), ("TESTBED_TP", 1), ("TESTBED_WORKERS", 0), (slots_key, 1)):
            raw = values.get(key, "").strip()
            if not raw.isdigit() or int(raw) < least:
                raise ConfigError(f"{key}={raw!r} is invalid; use a whole number >= {least}")
            numbers[key] = int(raw)
        spec = IMAGE_MODELS.get(values.get("TESTBED_MODEL", "").rstrip("/") or "/")
        return cls(numbers["TESTBED_PP"], numbers["TESTBED_TP"], numbers["TESTBED_WORKERS"], numbers[slots_key],
                   spec.num_layers if spec else None)

    @property
    def nodes(self) -> int:
        return 1 + self.workers

    @property
    def world(self) -> int:
        return self.pp * self.tp

    def problem(self) -> str | None:
        """Why vLLM cannot serve this over these nodes, in one line that names the fix; None where it can."""
        shape = f"TESTBED_PP={self.pp} x TESTBED_TP={self.tp} = {self.world} ranks"
        nodes = f"{self.nodes} node(s) (head + TESTBED_WORKERS={self.workers}) of {self.slots} devices each"
        if self.world > self.nodes * self.slots:
            more = -(-self.world // self.slots) - 1
            return f"{shape} do not fit {nodes}: use TESTBED_WORKERS={more}, or fewer ranks"
        if self.world <= (self.nodes - 1) * self.slots:
            fit = -(-self.world // self.slots)
            pp = (f"TESTBED_PP={self.nodes * self.slots // self.tp} or "
                  if self.tp <= self.slots and self.slots % self.tp == 0 else "")
            return f"{shape} fill {fit} of {nodes}: a node would idle; use {pp}TESTBED_WORKERS={fit - 1}"
        if self.layers is not None and self.pp > self.layers:
            return (f"TESTBED_PP={self.pp} stages for a model of {self.layers} layers: each stage needs one; "
                    f"use at most {self.layers}")
        return None

    def ranks_per_node(self) -> list[list[int]]:
        """The ranks each node holds, head first: consecutive runs of ``slots`` ranks."""
        return [list(range(start, min(start + self.slots, self.world))) for start in range(0, self.world, self.slots)]

    def mismatches(self, placement: list[RankPlacement]) -> list[str]:
        """What in ``placement`` differs from ``ranks_per_node`` (empty: as expected). Which worker holds
        which run is Ray's pick (its node ids' order), so the runs are compared, not the nodes' names."""
        found: dict[str, list[int]] = {}
        for placed in sorted(placement, key=lambda p: p.rank):
            found.setdefault(placed.node, []).append(placed.rank)
        problems = []
        if sorted(p.rank for p in placement) != list(range(self.world)):
            problems.append(f"ranks {sorted(p.rank for p in placement)}, want 0..{self.world - 1}")
        want = sorted(self.ranks_per_node())
        if sorted(found.values()) != want:
            problems.append(f"ranks per node {dict(sorted(found.items()))}, want runs {want} on {len(want)} nodes")
        return problems


def parse_testbed_ranks(log: str, node_by_ip: Mapping[str, str], tp_size: int) -> list[RankPlacement]:
    """Return each rank's placement from the testbed communicator's ``testbed rank`` lines (latest wins)."""
    ranks: dict[int, RankPlacement] = {}
    for match in _TESTBED_RANK_LINE.finditer(log):
        rank, ip = int(match["rank"]), match["ip"]
        ranks[rank] = RankPlacement(rank, ip, node_by_ip.get(ip, "?"), rank // tp_size, rank % tp_size)
    return [ranks[r] for r in sorted(ranks)]


def parse_placement(log: str, node_by_ip: Mapping[str, str], driver_ip: str, tp_size: int) -> list[RankPlacement]:
    """Return each rank's placement found in ``log`` (latest line per rank), by rank.

    From the testbed's own rank lines when present (every executor logs them);
    else from vLLM's, where ``driver_ip`` is the node of the engine that logged
    (its workers carry no IP). vLLM lays ranks out TP-innermost: PP stage =
    rank // TP, TP rank = rank % TP.
    """
    ours = parse_testbed_ranks(log, node_by_ip, tp_size)
    if ours:
        return ours
    ranks: dict[int, RankPlacement] = {}
    for match in _RANK_LINE.finditer(log):
        rank, ip = int(match["rank"]), match["ip"] or driver_ip
        ranks[rank] = RankPlacement(rank, ip, node_by_ip.get(ip, "?"), rank // tp_size, rank % tp_size)
    return [ranks[r] for r in sorted(ranks)]


def parse_placement_by_pid(log: str, node_by_ip: Mapping[str, str], tp_size: int) -> list[RankPlacement]:
    """Return each rank's placement by joining, on pid, vLLM's rank line and our mode line.

    For nodes on one machine (local backend), where pids are unique and Ray's
    ``ip=`` tag is not: every node's log monitor tails the shared log directory.
    """
    ours = parse_testbed_ranks(log, node_by_ip, tp_size)
    if ours:
        return ours
    ip_by_pid = {m["pid"]: m["ip"] for m in _WORKER_NODE_LINE.finditer(log)}
    ranks: dict[int, RankPlacement] = {}
    for match in _VLLM_RANK_LINE.finditer(log):
        rank, ip = int(match["rank"]), ip_by_pid.get(match["pid"], "?")
        ranks[rank] = RankPlacement(rank, ip, node_by_ip.get(ip, "?"), rank // tp_size, rank % tp_size)
    return [ranks[r] for r in sorted(ranks)]


def parse_mode_lines(log: str) -> list[str]:
    """Return every process's ``testbed modes`` line in ``log``."""
    return [line.strip() for line in log.splitlines() if _MODES_LINE.search(line)]


def describe(base_url: str, model: str, placement: list[RankPlacement], mode_lines: list[str]) -> str:
    """Return the report ``make up`` prints: API, ranks per PP stage, modes per process."""
    lines = [f"API: {base_url} (model {model})"]
    stages: dict[int, list[RankPlacement]] = {}
    for placed in placement:
        stages.setdefault(placed.pp_rank, []).append(placed)
    for stage, ranks in sorted(stages.items()):
        where = ", ".join(f"rank {r.rank} (TP {r.tp_rank}) on {r.node} {r.ip}" for r in ranks)
        lines.append(f"PP stage {stage}: {where}")
    if not stages:
        lines.append("PP stages: not found in the head's log (yet)")
    lines.append("patch modes per process:")
    lines += [f"  {line}" for line in mode_lines]
    return "\n".join(lines)
