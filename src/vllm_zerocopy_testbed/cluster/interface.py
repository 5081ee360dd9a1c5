"""The one interface every suite talks to, whatever runs the nodes."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vllm_zerocopy_testbed.cluster.placement import RankPlacement
from vllm_zerocopy_testbed.config import ClusterSettings


class ClusterStartError(RuntimeError):
    """A cluster did not come up within its bound; the message carries the logs' tail."""


class Unsupported(NotImplementedError):
    """A backend cannot do this (e.g. cut a loopback node off its network): the test says so and skips."""


class Service(ABC):
    """Something we start and must stop: a context manager whose exit always brings it down.

    ``__exit__`` runs ``down``, also when ``up`` failed half-way.
    """

    @abstractmethod
    def up(self) -> float:
        """Start everything and wait (bounded) until healthy; return the seconds it took."""

    @abstractmethod
    def down(self) -> None:
        """Stop and remove everything this started (bounded)."""

    def leftovers(self) -> list[str]:
        """Return what was left behind after ``down`` (containers, networks, processes, shm files)."""
        return []

    def __enter__(self) -> "Service":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


class Cluster(Service):
    """A vLLM cluster: up with a bounded wait, queried, hurt on purpose, always brought down."""

    settings: ClusterSettings

    @property
    @abstractmethod
    def base_url(self) -> str:
        """The OpenAI-compatible API root, ending in ``/v1``."""

    @abstractmethod
    def is_running(self) -> bool:
        """Whether the cluster is already up and healthy."""

    def serves(self, settings: dict[str, str]) -> bool:
        """Whether a cluster is already up, healthy, and configured with ``settings`` (reusable)."""
        return False

    @abstractmethod
    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        """Server and node logs (of one service if named)."""

    @abstractmethod
    def placement(self) -> list[RankPlacement]:
        """Where each vLLM rank runs."""

    @abstractmethod
    def mode_lines(self) -> list[str]:
        """Every process's ``testbed modes`` line."""

    # -- nemeses: what goes wrong on purpose (nemesis.py); ``node`` is "head" or "worker" --------
    # Operations a backend cannot do, and why (the tests that need one skip with the reason).
    UNSUPPORTED: dict[str, str] = {}

    def cannot(self, op: str) -> str | None:
        """Why this backend cannot do nemesis operation ``op`` (``pause``, ``isolate``...), or None."""
        if op in self.UNSUPPORTED:
            return self.UNSUPPORTED[op]
        if getattr(type(self), op, None) is getattr(Cluster, op, None):
            return f"{type(self).__name__} has no {op!r}"
        return None

    def kill(self, node: str) -> None:
        """Kill every process of a node at once (SIGKILL), as a lost host."""
        raise Unsupported(f"{type(self).__name__} cannot kill a node")

    def pause(self, node: str) -> None:
        """Freeze every process of a node (SIGSTOP / ``docker pause``): alive, connections open, silent."""
        raise Unsupported(f"{type(self).__name__} cannot pause a node")

    def resume(self, node: str) -> None:
        """Undo ``pause`` (a no-op where the node is not paused)."""
        raise Unsupported(f"{type(self).__name__} cannot resume a node")

    def isolate(self, node: str) -> None:
        """Cut a node off the cluster's network, its processes running."""
        raise Unsupported(f"{type(self).__name__} cannot isolate a node")

    def rejoin(self, node: str) -> None:
        """Undo ``isolate`` (a no-op where the node is not isolated or is gone)."""
        raise Unsupported(f"{type(self).__name__} cannot rejoin a node")

    def restart(self, node: str) -> None:
        """Stop a node (bounded grace) and start it again with the same settings."""
        raise Unsupported(f"{type(self).__name__} cannot restart a node")

    def kill_process(self, node: str, pattern: str) -> list[int]:
        """SIGKILL the processes of a node whose command line contains ``pattern``; return their PIDs."""
        raise Unsupported(f"{type(self).__name__} cannot kill a process on a node")

    def state(self, node: str) -> str:
        """Return the node's state: running, paused, isolated, exited or missing."""
        raise Unsupported(f"{type(self).__name__} cannot report a node's state")
