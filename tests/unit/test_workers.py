"""More worker nodes from one setting: node names as data, each name's container, the ranks each node
must hold for PP x TP over 1 + TESTBED_WORKERS nodes, and the one line that refuses a shape at start.

No Docker engine is needed: compose commands are recorded, not run (the render test runs
``docker compose config``, which starts nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_zerocopy_testbed.cluster import compose as compose_module
from vllm_zerocopy_testbed.cluster.compose import ComposeCluster, find_node, node_of
from vllm_zerocopy_testbed.cluster.interface import ClusterStartError, node_names, parse_node
from vllm_zerocopy_testbed.cluster.placement import RankPlacement, Topology
from vllm_zerocopy_testbed.config import ConfigError
from vllm_zerocopy_testbed.host_config import ClusterSettings

pytestmark = pytest.mark.unit

PROJECT = "zerocopy-testbed"


def _settings(**values: str) -> ClusterSettings:
    return ClusterSettings.from_env(values)


def _info(service: str, number: int, cid: str) -> dict:
    """One ``docker inspect`` entry as compose labels its containers."""
    return {"Id": cid, "Name": f"/{PROJECT}-{service}-{number}",
            "Config": {"Labels": {"com.docker.compose.service": service,
                                  "com.docker.compose.container-number": str(number)}},
            "State": {"Status": "running"}, "NetworkSettings": {"Networks": {f"{PROJECT}_testbed": {}}}}


INFOS = [_info("head", 1, "h1"), _info("worker", 2, "w2"), _info("worker", 1, "w1")]


# -- node names -------------------------------------------------------------------------------
def test_node_names_keep_worker_for_the_first_worker() -> None:
    assert node_names(0) == ["head"]
    assert node_names(1) == ["head", "worker"]
    assert node_names(2) == ["head", "worker", "worker-2"]
    assert node_names(3) == ["head", "worker", "worker-2", "worker-3"]


@pytest.mark.parametrize("name, parsed", [("head", ("head", 1)), ("worker", ("worker", 1)),
                                          ("worker-1", ("worker", 1)), ("worker-2", ("worker", 2))])
def test_a_node_name_is_its_kind_and_number(name: str, parsed: tuple[str, int]) -> None:
    assert parse_node(name) == parsed


@pytest.mark.parametrize("name", ["head-2", "worker-0", "worker-02", "worker-x", "gpu", ""])
def test_a_name_no_node_has_is_refused(name: str) -> None:
    with pytest.raises(LookupError, match="head, worker"):
        parse_node(name)


def test_a_compose_cluster_has_one_node_per_worker_replica() -> None:
    assert ComposeCluster(_settings()).nodes() == ["head", "worker"]  # compose/.env: TESTBED_WORKERS=1
    assert ComposeCluster(_settings(TESTBED_WORKERS="2")).nodes() == ["head", "worker", "worker-2"]


# -- each name's container --------------------------------------------------------------------
def test_each_replica_is_named_by_its_compose_number() -> None:
    assert [node_of(i) for i in INFOS] == ["head", "worker-2", "worker"]


@pytest.mark.parametrize("node, cid", [("head", "h1"), ("worker", "w1"), ("worker-1", "w1"), ("worker-2", "w2")])
def test_a_node_maps_to_its_own_container(node: str, cid: str) -> None:
    assert find_node(INFOS, node)["Id"] == cid


def test_a_worker_beyond_the_replicas_is_not_found() -> None:
    with pytest.raises(LookupError, match="there: head, worker, worker-2"):
        find_node(INFOS, "worker-3")


class Recorded(ComposeCluster):
    """A compose cluster whose compose and docker commands are recorded, answered from ``INFOS``."""

    def __init__(self, settings: ClusterSettings) -> None:
        super().__init__(settings)
        self.commands: list[list[str]] = []

    def compose(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.commands.append(["compose", *args])
        if args[:3] == ("ps", "-q", "-a"):  # _inspect: the ids of the service named, or all
            ids = [i["Id"] for i in INFOS
                   if len(args) == 3 or i["Config"]["Labels"]["com.docker.compose.service"] == args[3]]
            return subprocess.CompletedProcess(args, 0, "\n".join(ids), "")
        return subprocess.CompletedProcess(args, 1 if args[0] == "up" else 0, "", "")

    def _run(self, args, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.commands.append(list(args))
        if args[:2] == ["docker", "inspect"]:
            return subprocess.CompletedProcess(args, 0, json.dumps([i for i in INFOS if i["Id"] in args[2:]]), "")
        return subprocess.CompletedProcess(args, 0, "", "")

    def claim(self, auto: bool | None = None) -> None:
        pass

    def prepare(self) -> None:
        pass


@pytest.mark.parametrize("workers", ["1", "2"])
def test_up_scales_the_worker_service_to_the_setting(workers: str) -> None:
    cluster = Recorded(_settings(TESTBED_WORKERS=workers))
    with pytest.raises(ClusterStartError, match="compose up failed"):  # the recorder answers `up` with 1
        cluster.up()
    ups = [c for c in cluster.commands if c[1:2] == ["up"]]
    assert ups == [["compose", "up", "-d", "--scale", f"worker={workers}"]]


def test_nemeses_reach_the_named_replica() -> None:
    cluster = Recorded(_settings(TESTBED_WORKERS="2"))
    cluster.kill("worker-2")
    cluster.pause("worker")
    assert [c for c in cluster.commands if c[0] == "docker" and c[1] != "inspect"] == [
        ["docker", "kill", "w2"], ["docker", "pause", "w1"]]
    assert cluster.state("worker-2") == "running" and cluster.state("worker-3") == "missing"


def test_logs_of_one_replica_name_its_index_and_one_worker_keeps_the_old_command() -> None:
    two = Recorded(_settings(TESTBED_WORKERS="2"))
    two.logs("worker-2", tail=5)
    two.logs("head")
    assert two.commands == [["compose", "logs", "--no-color", "--tail", "5", "--index", "2", "worker"],
                            ["compose", "logs", "--no-color", "head"]]
    one = Recorded(_settings())
    one.logs("worker")
    one.logs()
    assert one.commands == [["compose", "logs", "--no-color", "worker"], ["compose", "logs", "--no-color"]]


def test_start_progress_names_every_node() -> None:
    assert Recorded(_settings(TESTBED_WORKERS="2"))._start_progress().startswith(
        "head running, worker running, worker-2 running")


# -- the expected placement -------------------------------------------------------------------
def _placed(runs: dict[str, list[int]], tp: int = 2) -> list[RankPlacement]:
    return [RankPlacement(rank, f"10.0.0.{i}", node, rank // tp, rank % tp)
            for i, (node, ranks) in enumerate(runs.items()) for rank in ranks]


def test_one_worker_holds_pp_stage_1_as_before() -> None:
    topology = Topology.from_settings(_settings().values)
    assert (topology.pp, topology.tp, topology.nodes, topology.problem()) == (2, 2, 2, None)
    assert topology.ranks_per_node() == [[0, 1], [2, 3]]
    assert topology.mismatches(_placed({"head-1": [0, 1], "worker-1": [2, 3]})) == []


def test_two_workers_alone_give_one_stage_per_node() -> None:
    settings = _settings(TESTBED_WORKERS="2")
    assert settings["TESTBED_PP"] == "3", "TESTBED_WORKERS named without TESTBED_PP: PP = 1 + workers"
    topology = Topology.from_settings(settings.values)
    assert (topology.pp, topology.world, topology.nodes, topology.problem()) == (3, 6, 3, None)
    assert topology.ranks_per_node() == [[0, 1], [2, 3], [4, 5]]
    # which worker holds which stage is Ray's pick
    assert topology.mismatches(_placed({"head-1": [0, 1], "worker-2": [2, 3], "worker-1": [4, 5]})) == []


@pytest.mark.parametrize("runs", [{"head-1": [0, 1], "worker-1": [2, 3, 4, 5]},  # two stages share a node
                                  {"head-1": [0, 2], "worker-1": [1, 3], "worker-2": [4, 5]},  # TP spans nodes
                                  {"head-1": [0, 1], "worker-1": [2, 3]}])  # a stage missing
def test_a_placement_off_the_expected_runs_is_named(runs: dict[str, list[int]]) -> None:
    assert Topology.from_settings(_settings(TESTBED_WORKERS="2").values).mismatches(_placed(runs))


def test_a_pp_named_explicitly_is_kept() -> None:
    assert _settings(TESTBED_WORKERS="2", TESTBED_PP="2")["TESTBED_PP"] == "2"
    assert _settings(TESTBED_PP="2")["TESTBED_PP"] == "2"


# -- bad input: one line, before anything starts ----------------------------------------------
@pytest.mark.parametrize("values, line", [
    ({"TESTBED_PP": "3"}, "TESTBED_PP=3 x TESTBED_TP=2 = 6 ranks do not fit 2 node(s) (head + TESTBED_WORKERS=1) "
                          "of 2 devices each: use TESTBED_WORKERS=2, or fewer ranks"),
    ({"TESTBED_WORKERS": "2", "TESTBED_PP": "2"}, "TESTBED_PP=2 x TESTBED_TP=2 = 4 ranks fill 2 of 3 node(s) (head + "
                                                  "TESTBED_WORKERS=2) of 2 devices each: a node would idle; use "
                                                  "TESTBED_PP=3 or TESTBED_WORKERS=1"),
    ({"TESTBED_WORKERS": "4"}, "TESTBED_PP=5 stages for a model of 4 layers: each stage needs one; use at most 4"),
])
def test_a_shape_the_nodes_cannot_serve_is_one_line(values: dict[str, str], line: str) -> None:
    assert Topology.from_settings(_settings(**values).values).problem() == line


def test_make_up_refuses_it_before_any_container_starts(monkeypatch, capsys) -> None:
    for name in ("TESTBED_TP", "TESTBED_HPU_PER_NODE", "TESTBED_PROFILE", "TESTBED_MODEL"):
        monkeypatch.delenv(name, raising=False)  # compose/.env's: TP=2, two devices per node
    monkeypatch.setenv("TESTBED_WORKERS", "2")
    monkeypatch.setenv("TESTBED_PP", "2")
    started: list[str] = []
    for name in ("claim", "prepare", "compose"):
        monkeypatch.setattr(ComposeCluster, name, lambda self, *a, _n=name, **k: started.append(_n))
    with pytest.raises(SystemExit) as exited:
        compose_module.main(["up"])
    message = str(exited.value.code)
    assert message.startswith("make up failed: TESTBED_PP=2 x TESTBED_TP=2 = 4 ranks fill 2 of 3 node(s)")
    assert "\n" not in message and "compose" not in started and "prepare" not in started


@pytest.mark.parametrize("values, name", [({"TESTBED_WORKERS": "two"}, "TESTBED_WORKERS"),
                                          ({"TESTBED_TP": "0"}, "TESTBED_TP")])
def test_a_knob_that_is_not_a_number_is_named(values: dict[str, str], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Topology.from_settings(_settings(**values).values)


# -- the compose file -------------------------------------------------------------------------
def test_the_worker_service_can_be_scaled() -> None:
    """Replicas of one service share its settings: no fixed name, address or published port on the worker."""
    settings = _settings(TESTBED_WORKERS="2")
    compose = Path(sys.executable).with_name("docker-compose")
    files = [arg for f in settings.compose_files for arg in ("-f", str(f))]
    out = subprocess.run([str(compose), *files, "config", "--format", "json"], env=ComposeCluster(settings)._env,
                         capture_output=True, text=True, timeout=60, check=True)
    worker = json.loads(out.stdout)["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert all(not (net or {}).get("ipv4_address") for net in worker["networks"].values())
    assert worker["cpuset"] == settings["WORKER_CPUSET"]
