"""The one interface every suite talks to, whatever runs the nodes."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vllm_zerocopy_testbed.cluster.placement import RankPlacement
from vllm_zerocopy_testbed.config import ClusterSettings


class ClusterStartError(RuntimeError):
    """A cluster did not come up within its bound; the message carries the logs' tail."""


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

    @abstractmethod
    def kill(self, service: str) -> None:
        """Kill a node (nemesis)."""
