"""Reading rank placement and mode lines from real vLLM 0.32 + Ray 2.60 head logs."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.cluster.placement import describe, parse_mode_lines, parse_placement, parse_placement_by_pid

pytestmark = pytest.mark.unit

# Lines as the head container logged them (ANSI colour codes kept).
HEAD_LOG = """\
head-1  | \x1b[36m(RayWorkerProc pid=190, ip=172.29.77.2)\x1b[0m (Worker pid=190) INFO 11-29 19:45:33 [parallel_state.py:1906] world_size=4 rank=2 local_rank=0 distributed_init_method=tcp://172.29.77.10:40139 backend=gloo
head-1  | \x1b[36m(RayWorkerProc pid=220, ip=172.29.77.2)\x1b[0m (Worker pid=220) INFO 11-29 19:45:33 [parallel_state.py:1906] world_size=4 rank=3 local_rank=1 distributed_init_method=tcp://172.29.77.10:40139 backend=gloo
head-1  | \x1b[36m(RayWorkerProc pid=410)\x1b[0m (Worker pid=410) INFO 11-29 19:45:33 [parallel_state.py:1906] world_size=4 rank=0 local_rank=0 distributed_init_method=tcp://172.29.77.10:40139 backend=gloo
head-1  | \x1b[36m(RayWorkerProc pid=433)\x1b[0m (Worker pid=433) INFO 11-29 19:45:33 [parallel_state.py:1906] world_size=4 rank=1 local_rank=1 distributed_init_method=tcp://172.29.77.10:40139 backend=gloo
head-1  | INFO 11-29 19:44:50 [testbed] testbed modes pid=6 role=api-server broadcast=testbed detach=testbed
head-1  | \x1b[36m(RayWorkerProc pid=190, ip=172.29.77.2)\x1b[0m INFO 11-29 19:45:31 [testbed] testbed modes pid=190 role=ray-worker broadcast=off detach=testbed
"""
NODES = {"172.29.77.10": "head-1", "172.29.77.2": "worker-1"}


def test_every_rank_is_placed_with_the_driver_node_for_lines_without_ip() -> None:
    placed = parse_placement(HEAD_LOG, NODES, driver_ip="172.29.77.10", tp_size=2)
    assert [(p.rank, p.node, p.pp_rank, p.tp_rank) for p in placed] == [
        (0, "head-1", 0, 0), (1, "head-1", 0, 1), (2, "worker-1", 1, 0), (3, "worker-1", 1, 1)]


def test_mode_lines_and_report() -> None:
    lines = parse_mode_lines(HEAD_LOG)
    assert len(lines) == 2 and "role=ray-worker broadcast=off" in lines[1]
    report = describe("http://127.0.0.1:8000/v1", "tiny-llama",
                      parse_placement(HEAD_LOG, NODES, "172.29.77.10", 2), lines)
    assert "PP stage 0: rank 0 (TP 0) on head-1 172.29.77.10, rank 1 (TP 1) on head-1" in report
    assert "PP stage 1: rank 2 (TP 0) on worker-1 172.29.77.2" in report


# Local backend: both nodes' log monitors tail one directory, so every worker line comes
# twice, with either node's tag; only vLLM's pid and the worker's own node= are reliable.
LOCAL_LOG = """\
\x1b[36m(RayWorkerProc pid=29565)\x1b[0m INFO 11-29 20:56:20 [testbed] testbed modes pid=29565 role=ray-worker broadcast=testbed detach=testbed node=127.0.0.3
\x1b[36m(RayWorkerProc pid=29541, ip=127.0.0.2)\x1b[0m INFO 11-29 20:56:20 [testbed] testbed modes pid=29541 role=ray-worker broadcast=testbed detach=testbed node=127.0.0.2
\x1b[36m(RayWorkerProc pid=29565, ip=127.0.0.2)\x1b[0m (Worker pid=29565) INFO 11-29 20:56:22 [parallel_state.py:1906] world_size=4 rank=1 local_rank=1 distributed_init_method=tcp://127.0.0.3:36597 backend=gloo
\x1b[36m(RayWorkerProc pid=29541)\x1b[0m (Worker pid=29541) INFO 11-29 20:56:23 [parallel_state.py:1906] world_size=4 rank=2 local_rank=0 distributed_init_method=tcp://127.0.0.3:36597 backend=gloo
"""


def test_local_placement_joins_vllm_rank_lines_with_the_workers_own_node() -> None:
    placed = parse_placement_by_pid(LOCAL_LOG, {"127.0.0.3": "head", "127.0.0.2": "worker-1"}, tp_size=2)
    assert [(p.rank, p.node, p.pp_rank) for p in placed] == [(1, "head", 0), (2, "worker-1", 1)]


def test_testbed_rank_lines_place_ranks_for_any_executor() -> None:
    """The compiled-graph executor logs no rank lines of vLLM's: ours are enough."""
    from vllm_zerocopy_testbed.cluster.placement import parse_placement

    log = "\n".join(f"(RayWorkerWrapper pid={100 + r}, ip=172.29.77.2) INFO [host_aware_communicator.py:1] "
                     f"testbed rank pid={100 + r} rank={r} node={'172.29.77.10' if r < 2 else '172.29.77.2'}"
                     for r in range(4))
    placed = parse_placement(log, {"172.29.77.10": "head", "172.29.77.2": "worker"}, "172.29.77.10", tp_size=2)
    assert [(p.rank, p.node, p.pp_rank, p.tp_rank) for p in placed] == [
        (0, "head", 0, 0), (1, "head", 0, 1), (2, "worker", 1, 0), (3, "worker", 1, 1)]
