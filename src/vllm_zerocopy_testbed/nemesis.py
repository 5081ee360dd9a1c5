"""Nemeses: what goes wrong on purpose, on the compose cluster, while a workload runs.

Each nemesis has ``apply`` (at the fault time) and ``heal`` (after the checker's
window: what an operator would undo, e.g. unpause, reconnect). Recovery itself
is the cluster's job (restart policies, the head's watchdog) or ``make up``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from vllm_zerocopy_testbed.cluster.compose import ComposeCluster

# Longer than Ray's node-death detection and the watchdog's grace: the fault is a loss, not a blip.
HOLD_S = 45.0


@dataclass(frozen=True)
class Nemesis:
    name: str
    what: str
    apply: Callable[[ComposeCluster], None]
    heal: Callable[[ComposeCluster], None] = lambda cluster: None

    def __str__(self) -> str:
        return self.name


def _pause_then_hold(cluster: ComposeCluster) -> None:
    cluster.pause("worker")


def _unpause(cluster: ComposeCluster) -> None:
    if cluster.state("worker") == "paused":
        cluster.unpause("worker")


def _reconnect(cluster: ComposeCluster) -> None:
    if cluster.state("worker") == "running":
        cluster.connect("worker")


def _kill_head_ray_worker(cluster: ComposeCluster) -> None:
    killed = cluster.kill_process("head", "ray::RayWorker")  # RayWorkerProc (V2) or RayWorkerWrapper (cgraph)
    if not killed:
        raise RuntimeError("no Ray worker actor process found in the head container")


NEMESES = (
    Nemesis("kill-worker-node", "docker kill of the worker node container (PP stage 1)",
            lambda c: c.kill("worker")),
    Nemesis("kill-ray-worker-actor", "SIGKILL of the head's Ray worker actor processes (PP stage 0)",
            _kill_head_ray_worker),
    Nemesis("pause-worker-node", f"docker pause of the worker node for {HOLD_S:.0f} s (longer than the step bound)",
            _pause_then_hold, _unpause),
    Nemesis("disconnect-worker-node", f"worker node off the cluster network for {HOLD_S:.0f} s",
            lambda c: c.disconnect("worker"), _reconnect),
    Nemesis("restart-worker-node", "docker restart of the worker node (10 s grace)", lambda c: c.restart("worker")),
)


def by_name(name: str) -> Nemesis:
    return next(n for n in NEMESES if n.name == name)


def hold() -> None:
    """Wait the fault's hold time (the faults stay on while the checker's window runs)."""
    time.sleep(HOLD_S)
