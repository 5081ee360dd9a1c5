"""An external cluster: one that already runs (other hosts, KubeRay, a `make up` of someone else),
observed and never hurt (``TESTBED_CLUSTER=external``).

The suites send it the same requests and judge the answers the same way. It is
never started, stopped or signalled: ``up`` only waits (bounded) for ``/health``,
``down`` does nothing, every nemesis operation is unsupported and the suites that
need a cluster of their own skip. What it cannot show is said (``blind_to``):

* with a Ray dashboard (``TESTBED_EXTERNAL_DASHBOARD``), Ray's state API gives the
  nodes, the vLLM worker actors and their logs: placement (from vLLM's or the
  testbed's rank lines) and the workers' mode lines;
* never the engine's and API server's own lines (the transport and timeline
  checkers' evidence): the engine is Ray's driver, not an actor, so its log is on
  its host only.

Every HTTP call has a timeout; the dashboard is only read.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from typing import Any

from vllm_zerocopy_testbed.cluster.interface import NEMESIS_OPERATIONS, Cluster, ClusterStartError
from vllm_zerocopy_testbed.cluster.placement import RankPlacement, parse_mode_lines, parse_placement
from vllm_zerocopy_testbed.config import ConfigError
from vllm_zerocopy_testbed.host_config import ClusterSettings, ExternalTarget
from vllm_zerocopy_testbed.waits import WaitTimeout, wait_until
from vllm_zerocopy_testbed.workload.warmup import is_healthy

HTTP_TIMEOUT_S = 10.0
# up(): an external cluster is either answering or not ours to wait long for.
HEALTH_WAIT_S = 120.0
# Per worker log file read from the dashboard (the rank and mode lines come first).
LOG_LINES = 20000
# vLLM's Ray worker actors: RayExecutorV2's and the compiled-graph executor's.
WORKER_CLASSES = ("RayWorkerProc", "RayWorkerWrapper")

NO_DASHBOARD = ("no Ray dashboard named (TESTBED_EXTERNAL_DASHBOARD=http://HEAD:8265): the workers' "
                "placement and mode lines are read from Ray's state API there")
NO_ENGINE_LOG = ("an external cluster's engine and API server log on their own host only (the engine is "
                 "Ray's driver, not an actor): transport frames and the MessageQueue timeline are not "
                 "checked; run the suite on TESTBED_CLUSTER=compose or local for them")


def get_json(url: str, timeout: float = HTTP_TIMEOUT_S) -> Any:
    """GET ``url`` and parse its JSON body (raises ``OSError``/``ValueError`` on failure)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def served_models(base_url: str) -> list[dict[str, Any]]:
    """The model cards ``/v1/models`` lists (``id``, and ``max_model_len`` where vLLM gives it)."""
    return list(get_json(f"{base_url}/models").get("data", []))


class ExternalCluster(Cluster):
    """A running deployment reached over HTTP: its API, and optionally its Ray dashboard."""

    owned = False
    UNSUPPORTED = {op: "an external cluster is observed, never hurt: nemeses run on TESTBED_CLUSTER=compose "
                       "or local" for op in NEMESIS_OPERATIONS}

    def __init__(self, settings: ClusterSettings, target: ExternalTarget | None = None,
                 up_timeout: float = HEALTH_WAIT_S) -> None:
        self.settings = settings
        self.target = target or ExternalTarget.from_env()
        self.up_timeout = min(up_timeout, HEALTH_WAIT_S)
        self._model: str | None = None

    @property
    def base_url(self) -> str:
        return self.target.url

    @property
    def root(self) -> str:
        return self.target.url.removesuffix("/v1")

    def is_running(self) -> bool:
        return is_healthy(self.root)

    def serves(self, settings: dict[str, str]) -> bool:
        """Whether it answers; the settings are what it is said to run (it is never restarted)."""
        if not self.is_running():
            return False
        self._adopt_model()
        return True

    def up(self) -> float:
        """Wait (bounded) until it answers ``/health``; start nothing."""
        start = time.monotonic()
        try:
            wait_until(f"the external cluster at {self.root}/health", self.is_running, timeout=self.up_timeout,
                       poll_s=2)
        except WaitTimeout as exc:
            raise ClusterStartError(f"{exc}: an external cluster is not started by the testbed; is it up, and is "
                                    f"TESTBED_EXTERNAL_URL={self.target.url} its OpenAI API?") from None
        self._adopt_model()
        return time.monotonic() - start

    def down(self) -> None:
        """Nothing: the testbed did not start it and never stops it."""

    def _adopt_model(self) -> None:
        """Take the served model's name (and max_model_len) into the settings the suites read."""
        if self._model is not None:
            return
        try:
            cards = served_models(self.base_url)
        except (OSError, ValueError) as exc:
            raise ClusterStartError(f"{self.base_url}/models did not answer with a model list: {exc}") from None
        names = [c.get("id") for c in cards]
        if self.target.model is not None and self.target.model not in names:
            raise ConfigError(f"TESTBED_EXTERNAL_MODEL={self.target.model!r} is not served at {self.base_url} "
                              f"(it serves: {', '.join(map(str, names)) or 'nothing'})")
        if self.target.model is None and len(names) != 1:
            raise ConfigError(f"{self.base_url} serves {len(names)} models ({', '.join(map(str, names))}): name "
                              f"the one to test with TESTBED_EXTERNAL_MODEL")
        self._model = self.target.model or str(names[0])
        card = next(c for c in cards if c.get("id") == self._model)
        values = {**self.settings.values, "TESTBED_SERVED_MODEL": self._model}
        if card.get("max_model_len"):
            values["TESTBED_MAX_MODEL_LEN"] = str(card["max_model_len"])
        self.settings = replace(self.settings, values=values)

    # -- what it shows ------------------------------------------------------
    def blind_to(self, what: str) -> str | None:
        if what == "engine-log":
            return NO_ENGINE_LOG
        if what in ("placement", "mode-lines") and self.target.dashboard is None:
            return NO_DASHBOARD
        return None

    def _state(self, resource: str) -> list[dict[str, Any]]:
        """One list from Ray's state API (``nodes``, ``actors``) on the dashboard."""
        body = get_json(f"{self.target.dashboard}/api/v0/{resource}?limit=10000&detail=1")
        if not body.get("result", True):
            raise RuntimeError(f"Ray's state API ({resource}): {body.get('msg')}")
        return list(body["data"]["result"]["result"])

    def node_names(self) -> dict[str, str]:
        """Node IP -> a name: ``head`` for the head node, else ``node-IP``."""
        return {n["node_ip"]: "head" if n.get("is_head_node") else f"node-{n['node_ip']}"
                for n in self._state("nodes")}

    def workers(self) -> list[dict[str, Any]]:
        """vLLM's live Ray worker actors (class, pid, node)."""
        return [a for a in self._state("actors")
                if a.get("state") == "ALIVE" and any(c in a.get("class_name", "") for c in WORKER_CLASSES)]

    def _actor_log(self, actor_id: str, suffix: str) -> str:
        query = urllib.parse.urlencode({"actor_id": actor_id, "suffix": suffix, "lines": LOG_LINES})
        try:
            with urllib.request.urlopen(f"{self.target.dashboard}/api/v0/logs/file?{query}",
                                        timeout=HTTP_TIMEOUT_S) as response:
                return response.read().decode(errors="replace")
        except (urllib.error.HTTPError, OSError):  # an actor whose log file is gone or empty
            return ""

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        """The vLLM workers' own logs from the dashboard, each line prefixed as Ray prefixes what it
        forwards to the driver (``(Class pid=N, ip=IP)``); empty without a dashboard."""
        if self.target.dashboard is None:
            return ""
        ips = {n["node_id"]: n["node_ip"] for n in self._state("nodes")}
        lines: list[str] = []
        for actor in self.workers():
            prefix = f"({actor['class_name']} pid={actor.get('pid')}, ip={ips.get(actor.get('node_id'), '?')})"
            for suffix in ("out", "err"):
                lines += [f"{prefix} {line}" for line in self._actor_log(actor["actor_id"], suffix).splitlines()]
        return "\n".join(lines[-tail:] if tail else lines)

    def placement(self) -> list[RankPlacement]:
        """Each rank's node, from the workers' rank lines (empty without a dashboard)."""
        if self.target.dashboard is None:
            return []
        return parse_placement(self.logs(), self.node_names(), "", int(self.settings["TESTBED_TP"]))

    def mode_lines(self) -> list[str]:
        """The Ray workers' ``testbed modes`` lines (a vLLM without the testbed's plugin logs none)."""
        return parse_mode_lines(self.logs())
