"""Where vLLM's ranks run and which modes each process has, read from server logs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

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
