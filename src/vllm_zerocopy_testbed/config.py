"""What every vLLM process of the testbed reads: the modes, the fault knobs, the process environment.

The host's tooling (cluster settings, e2e profiles, images) reads ``host_config.py``, which vLLM
processes never import. Every environment variable is read in one of the two, once."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the valid values."""


class PatchMode(str, enum.Enum):
    """How one zero-copy path behaves in a process."""

    UPSTREAM = "upstream"  # the installed vLLM, untouched
    OFF = "off"  # the behaviour before the upstream fix
    TESTBED = "testbed"  # this project's implementation

    @classmethod
    def parse(cls, value: str, *, variable: str) -> "PatchMode":
        try:
            return cls(value.strip().lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(
                f"{variable}={value!r} is not a patch mode; use one of: {valid}"
            ) from None


class CommunicatorChoice(str, enum.Enum):
    """Which CPU device communicator the platform plugin hands to vLLM."""

    HOST_AWARE = "host-aware"  # shared memory only when all ranks share /dev/shm
    STOCK = "stock"  # vLLM's CpuCommunicator as installed


class Executor(str, enum.Enum):
    """Which Ray executor vLLM serves with (one knob, ``TESTBED_EXECUTOR``)."""

    V2 = "v2"  # RayExecutorV2: control plane is the MessageQueue (shm ring + ZMQ)
    CGRAPH = "cgraph"  # legacy executor: Ray compiled graph, shm channels (the detach bug's home)

    @classmethod
    def parse(cls, value: str) -> "Executor":
        try:
            return cls(value.strip().lower())
        except ValueError:
            valid = ", ".join(e.value for e in cls)
            raise ConfigError(f"{EXECUTOR_ENV}={value!r} is invalid; use one of: {valid}") from None

    def vllm_env(self) -> dict[str, str]:
        """Return the vLLM environment variables that select this executor."""
        if self is Executor.V2:
            return {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}
        # shm: the NCCL channel type needs CUDA; on CPU only shm channels work
        return {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0", "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE": "shm"}


EXECUTOR_ENV = "TESTBED_EXECUTOR"
BROADCAST_ENV = "TESTBED_BROADCAST"
DETACH_ENV = "TESTBED_DETACH"
# The compiled-graph in-flight cap (patches/inflight.py, findings/cgraph-raylet-writeacquire); e2e profiles set
# it to the detach mode.
INFLIGHT_ENV = "TESTBED_INFLIGHT"
# vLLM 0.32's opt-in shared-memory tensor arena (patches/arena.py); used only where vLLM enables it.
ARENA_ENV = "TESTBED_ARENA"
COMMUNICATOR_ENV = "TESTBED_CPU_COMMUNICATOR"
PLATFORM_ENV = "TESTBED_CPU_PLATFORM"
# Ray resource name the CPU platform asks for per worker. `HPU` serves both the
# V2 executor and the compiled-graph executor: Ray's compiled graphs treat a
# `GPU` resource as CUDA and fail on CPU (see docs/design.md).
RAY_DEVICE_KEY_ENV = "TESTBED_RAY_DEVICE_KEY"
# Local backend only: the engine joins Ray as this node (see plugins/general.py).
RAY_DRIVER_IP_ENV = "TESTBED_RAY_DRIVER_IP"
# 1: log the timeline of every out-of-band MessageQueue buffer (patches/timeline.py).
MQ_TIMELINE_ENV = "TESTBED_MQ_TIMELINE"
# A stall injected on the broadcast, to show the latency checker red (patches/slowdown.py):
# empty (none) | stall:S (the engine's first broadcast of a tensor >= 1 MiB held S seconds).
FAULT_BROADCAST_ENV = "TESTBED_FAULT_BROADCAST"
# A leak planted on purpose, to show make soak red (patches/plant.py): empty (none) | outputs.
PLANT_LEAK_ENV = "TESTBED_PLANT_LEAK"
# Seconds between each vLLM process's heap figures (observe/heap.py, read by node/usage.py); 0: none.
HEAP_PROBE_ENV = "TESTBED_HEAP_PROBE_S"
# A diagnosis: N > 0 traces Python allocations (N frames each) in every vLLM process and writes
# where memory grew (observe/heap.py: _trace_loop); it slows every allocation. 0 (default): off.
HEAP_TRACE_ENV = "TESTBED_HEAP_TRACE"
# More environment for every process of a node (compose backend): NAME=VALUE words, e.g.
# MALLOC_ARENA_MAX=2 (node scripts export them before Ray starts; see node_env()).
NODE_ENV = "TESTBED_NODE_ENV"
# Bytes: cap every node container's TCP buffers (compose/compose.tcp-buffers.yaml); unset: the kernel's.
TCP_BUFFERS_ENV = "TESTBED_TCP_BUFFERS"


@dataclass(frozen=True)
class BroadcastFault:
    """A stall injected on the engine's MessageQueue broadcast (``TESTBED_FAULT_BROADCAST``)."""

    kind: str  # stall
    value: float  # seconds (> 0)

    @classmethod
    def parse(cls, raw: str) -> "BroadcastFault | None":
        """Parse ``stall:S``; None for an empty value."""
        raw = raw.strip().lower()
        if not raw:
            return None
        kind, _, value = raw.partition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if kind == "stall" and number > 0:
            return cls(kind, number)
        raise ConfigError(f"{FAULT_BROADCAST_ENV}={raw!r} is invalid; use stall:S (S seconds > 0) or nothing")

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}"


@dataclass(frozen=True)
class TestbedConfig:
    """Settings of one process, read from its environment."""

    __test__ = False  # not a pytest class, despite its name

    broadcast: PatchMode = PatchMode.TESTBED
    detach: PatchMode = PatchMode.TESTBED
    inflight: PatchMode = PatchMode.TESTBED
    arena: PatchMode = PatchMode.TESTBED
    communicator: CommunicatorChoice = CommunicatorChoice.HOST_AWARE
    cpu_platform: bool = True
    ray_device_key: str = "HPU"
    ray_driver_ip: str | None = None
    mq_timeline: bool = False
    broadcast_fault: BroadcastFault | None = None
    heap_probe_s: float = 30.0
    heap_trace_frames: int = 0
    plant_leak: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TestbedConfig":
        env = os.environ if env is None else env
        comm_raw = env.get(COMMUNICATOR_ENV, CommunicatorChoice.HOST_AWARE.value)
        try:
            communicator = CommunicatorChoice(comm_raw.strip().lower())
        except ValueError:
            valid = ", ".join(c.value for c in CommunicatorChoice)
            raise ConfigError(
                f"{COMMUNICATOR_ENV}={comm_raw!r} is invalid; use one of: {valid}"
            ) from None
        platform_raw = env.get(PLATFORM_ENV, "on").strip().lower()
        if platform_raw not in ("on", "off"):
            raise ConfigError(f"{PLATFORM_ENV}={platform_raw!r} is invalid; use on or off")
        timeline_raw = env.get(MQ_TIMELINE_ENV, "0").strip()
        if timeline_raw not in ("0", "1"):
            raise ConfigError(f"{MQ_TIMELINE_ENV}={timeline_raw!r} is invalid; use 0 or 1")
        key = env.get(RAY_DEVICE_KEY_ENV, "HPU").strip()
        if key not in ("HPU", "GPU"):
            raise ConfigError(f"{RAY_DEVICE_KEY_ENV}={key!r} is invalid; use HPU or GPU")
        probe_raw = env.get(HEAP_PROBE_ENV, "30").strip()
        try:
            heap_probe_s = float(probe_raw)
        except ValueError:
            heap_probe_s = -1.0
        if not heap_probe_s >= 0:  # also NaN
            raise ConfigError(f"{HEAP_PROBE_ENV}={probe_raw!r} is invalid; use seconds >= 0 (0: no heap figures)")
        trace_raw = env.get(HEAP_TRACE_ENV, "0").strip()
        if not trace_raw.isdigit():
            raise ConfigError(f"{HEAP_TRACE_ENV}={trace_raw!r} is invalid; use a number of frames (0: off)")
        plant = env.get(PLANT_LEAK_ENV, "").strip().lower()
        if plant not in ("", "outputs"):
            raise ConfigError(f"{PLANT_LEAK_ENV}={plant!r} is invalid; use outputs or nothing")
        return cls(
            plant_leak=plant,
            heap_probe_s=heap_probe_s,
            heap_trace_frames=int(trace_raw),
            broadcast=PatchMode.parse(env.get(BROADCAST_ENV, "testbed"), variable=BROADCAST_ENV),
            detach=PatchMode.parse(env.get(DETACH_ENV, "testbed"), variable=DETACH_ENV),
            inflight=PatchMode.parse(env.get(INFLIGHT_ENV, "testbed"), variable=INFLIGHT_ENV),
            arena=PatchMode.parse(env.get(ARENA_ENV, "testbed"), variable=ARENA_ENV),
            communicator=communicator,
            cpu_platform=platform_raw == "on",
            ray_device_key=key,
            ray_driver_ip=env.get(RAY_DRIVER_IP_ENV) or None,
            mq_timeline=timeline_raw == "1",
            broadcast_fault=BroadcastFault.parse(env.get(FAULT_BROADCAST_ENV, "")),
        )


REPO_ROOT = Path(__file__).resolve().parents[2]
# -- the process environment, for what is not a testbed knob ------------------------------------
# Ray >= 2.60 turns token authentication on for a new local ``ray.init()`` and writes
# ~/.ray/auth_token; every later Ray process that finds that file turns it on too, unless told
# otherwise, and a cluster whose processes disagree refuses its nodes (``InvalidAuthToken`` at
# join: every local-node test red after a user's one ``ray.init()``). The testbed's clusters are
# its own, on loopback or on its own container network: authentication off unless the user set it.
RAY_AUTH_DEFAULT = {"RAY_AUTH_MODE": "disabled"}


def process_env(**extra: str) -> dict[str, str]:
    """A copy of this process's environment plus ``extra``: what a child process we start gets
    (with Ray's token authentication off where the environment does not say, ``RAY_AUTH_DEFAULT``)."""
    return {**RAY_AUTH_DEFAULT, **os.environ, **extra}


def set_process_env(name: str, value: str) -> None:
    """Set one variable for this process and its children (a harness choosing vLLM's executor)."""
    os.environ[name] = value


VLLM_V2_EXECUTOR_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"


def vllm_uses_compiled_graph(env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM in this process runs the compiled-graph Ray executor (its default: V2)."""
    env = os.environ if env is None else env
    return env.get(VLLM_V2_EXECUTOR_ENV, "1").strip().lower() in ("0", "false")


def ray_address(env: Mapping[str, str] | None = None) -> str:
    """The Ray cluster this process joins (``RAY_ADDRESS``; Ray's own default ``auto``)."""
    env = os.environ if env is None else env
    return env.get("RAY_ADDRESS", "auto")
