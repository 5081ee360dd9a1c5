"""The external backend: a cluster the suites observe over HTTP and never start, stop or hurt.

Against a real HTTP server on loopback that answers as vLLM's OpenAI server (``/health``,
``/v1/models``) and, on its other routes, as Ray's dashboard (state API: nodes, actors,
actor logs). The e2e run against a real `make up` cluster is in docs/multihost.md.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

import pytest
from loopback import Loopback

from vllm_zerocopy_testbed.cluster.external import ExternalCluster
from vllm_zerocopy_testbed.cluster.interface import NEMESIS_OPERATIONS, ClusterStartError, Unsupported
from vllm_zerocopy_testbed.config import ConfigError, PatchMode
from vllm_zerocopy_testbed.host_config import ClusterSettings, ExternalTarget, e2e_profiles

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

HEAD, WORKER = "aa" * 28, "bb" * 28
WORKER_LOG = {  # vLLM's own rank line in each actor's log (no testbed plugin needed), a mode line
    "a0": "INFO world_size=4 rank=0 local_rank=0 distributed_init_method=tcp://x\n"
          "testbed modes pid=10 role=ray-worker broadcast=testbed detach=testbed inflight=testbed node=10.0.0.1",
    "a1": "INFO world_size=4 rank=1 local_rank=1 distributed_init_method=tcp://x",
    "a2": "INFO world_size=4 rank=2 local_rank=0 distributed_init_method=tcp://x",
    "a3": "INFO world_size=4 rank=3 local_rank=1 distributed_init_method=tcp://x",
    "x": "INFO world_size=1 rank=0 local_rank=0 (not a vLLM worker)",
}


class Deployment:
    """vLLM's API and Ray's dashboard routes on one loopback port; ``models`` and ``requests`` seen."""

    def __init__(self, models: tuple[str, ...] = ("tiny-llama",)) -> None:
        self.models = models
        self.requests: list[str] = []
        self.http = Loopback(self.route)
        self.url = self.http.url

    def route(self, method: str, path: str) -> tuple[int, object]:
        self.requests.append(f"{method} {path}")
        if method != "GET":
            return 405, ""
        url = urlsplit(path)
        state = {"nodes": [{"node_id": HEAD, "node_ip": "10.0.0.1", "is_head_node": True},
                           {"node_id": WORKER, "node_ip": "10.0.0.2", "is_head_node": False}],
                 "actors": [{"actor_id": f"a{r}", "class_name": "RayWorkerProc", "state": "ALIVE",
                             "pid": 10 + r, "node_id": HEAD if r < 2 else WORKER} for r in range(4)]
                 + [{"actor_id": "x", "class_name": "_StatsActor", "state": "ALIVE", "node_id": HEAD}]}
        if url.path == "/health":
            return 200, ""
        if url.path == "/v1/models":
            return 200, {"data": [{"id": m, "max_model_len": 4608} for m in self.models]}
        if url.path.startswith("/api/v0/") and url.path[8:] in state:
            return 200, {"result": True, "data": {"result": {"result": state[url.path[8:]]}}}
        if url.path == "/api/v0/logs/file":
            query = parse_qs(url.query)
            return 200, WORKER_LOG[query["actor_id"][0]] if query["suffix"] == ["err"] else ""
        return 404, "not found"

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def deployment():
    running = Deployment()
    yield running
    running.close()


def _cluster(url: str, dashboard: str | None = None, model: str | None = None, **kw: float) -> ExternalCluster:
    env = {"TESTBED_EXTERNAL_URL": url, "TESTBED_EXTERNAL_DASHBOARD": dashboard or "",
           "TESTBED_EXTERNAL_MODEL": model or ""}
    return ExternalCluster(ClusterSettings.from_env({}), ExternalTarget.from_env(env), **kw)


def test_target_urls_are_checked_and_normalised() -> None:
    with pytest.raises(ConfigError, match="TESTBED_EXTERNAL_URL"):
        ExternalTarget.from_env({})
    with pytest.raises(ConfigError, match="is invalid"):
        ExternalTarget.from_env({"TESTBED_EXTERNAL_URL": "10.0.0.5:8000"})
    with pytest.raises(ConfigError, match="TESTBED_EXTERNAL_DASHBOARD"):
        ExternalTarget.from_env({"TESTBED_EXTERNAL_URL": "http://h:8000", "TESTBED_EXTERNAL_DASHBOARD": "h:8265"})
    assert ExternalTarget.from_env({"TESTBED_EXTERNAL_URL": "http://h:8000"}).url == "http://h:8000/v1"
    assert ExternalTarget.from_env({"TESTBED_EXTERNAL_URL": "https://h/x/v1/"}).url == "https://h/x/v1"


def test_an_external_cluster_is_one_profile_as_named() -> None:
    env = {"TESTBED_CLUSTER": "external"}
    assert [str(p) for p in e2e_profiles(env)[0]] == ["v2/upstream"]
    profiles, chosen = e2e_profiles({**env, "TESTBED_E2E_EXECUTORS": "cgraph", "TESTBED_E2E_MODES": "testbed"})
    assert [str(p) for p in profiles] == ["cgraph/testbed"] and chosen
    with pytest.raises(ConfigError, match="one executor"):
        e2e_profiles({**env, "TESTBED_E2E_EXECUTORS": "v2 cgraph"})
    assert profiles[0].broadcast is PatchMode.TESTBED


def test_up_waits_for_health_takes_the_model_and_down_touches_nothing(deployment: Deployment) -> None:
    cluster = _cluster(deployment.url)
    assert cluster.up() < 5 and cluster.serves({})
    assert cluster.settings["TESTBED_SERVED_MODEL"] == "tiny-llama"
    assert cluster.settings["TESTBED_MAX_MODEL_LEN"] == "4608"
    cluster.down()
    assert cluster.is_running(), "down() must leave an external cluster as it was"
    assert not any(r.startswith("POST") for r in deployment.requests), deployment.requests
    assert not cluster.owned and cluster.leftovers() == []


def test_every_nemesis_operation_is_refused_with_a_reason(deployment: Deployment) -> None:
    cluster = _cluster(deployment.url)
    for op in NEMESIS_OPERATIONS:
        assert "never hurt" in (cluster.cannot(op) or ""), op
        args = ("worker", "raylet") if op == "signal_process" else ("worker",)
        with pytest.raises(Unsupported):
            getattr(cluster, op)(*args)


def test_an_unreachable_cluster_is_a_clear_error_within_the_bound() -> None:
    cluster = _cluster("http://127.0.0.1:9", up_timeout=1)
    start = time.monotonic()
    with pytest.raises(ClusterStartError, match="not started by the testbed"):
        cluster.up()
    assert time.monotonic() - start < 15


def test_several_models_need_one_named(deployment: Deployment) -> None:
    deployment.models = ("a", "b")
    with pytest.raises(ConfigError, match="TESTBED_EXTERNAL_MODEL"):
        _cluster(deployment.url).up()
    with pytest.raises(ConfigError, match="serves: a, b"):
        _cluster(deployment.url, model="c").up()
    assert _cluster(deployment.url, model="b").serves({})


def test_without_a_dashboard_placement_and_modes_are_said_to_be_unseen(deployment: Deployment) -> None:
    cluster = _cluster(deployment.url)
    assert "TESTBED_EXTERNAL_DASHBOARD" in cluster.blind_to("placement")
    assert "TESTBED_EXTERNAL_DASHBOARD" in cluster.blind_to("mode-lines")
    assert "own host" in cluster.blind_to("engine-log")
    assert cluster.placement() == [] and cluster.logs() == ""


def test_the_dashboard_gives_placement_and_the_workers_mode_lines(deployment: Deployment) -> None:
    cluster = _cluster(deployment.url, dashboard=deployment.url)
    assert cluster.blind_to("placement") is None and cluster.blind_to("engine-log")
    placed = {(p.rank, p.node, p.pp_rank, p.tp_rank) for p in cluster.placement()}
    assert placed == {(0, "head", 0, 0), (1, "head", 0, 1), (2, "node-10.0.0.2", 1, 0),
                      (3, "node-10.0.0.2", 1, 1)}
    [line] = cluster.mode_lines()
    assert "role=ray-worker broadcast=testbed" in line and line.startswith("(RayWorkerProc pid=10, ip=10.0.0.1)")
    assert "_StatsActor" not in cluster.logs()
