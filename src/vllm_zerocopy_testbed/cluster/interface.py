"""The one interface every suite talks to, whatever runs the nodes."""

from __future__ import annotations

import logging
import signal
import socket
import time
from abc import ABC, abstractmethod
from typing import NoReturn

from vllm_zerocopy_testbed.cluster.placement import RankPlacement
from vllm_zerocopy_testbed.host_config import ClusterSettings


logger = logging.getLogger(__name__)


# Node names are data: the head, then one per worker node. "worker" is the first worker, as it
# always was (nemeses, soak, docs name it); the n-th is "worker-n", and "worker-1" names the first too.
HEAD = "head"
WORKER = "worker"


def node_name(kind: str, number: int = 1) -> str:
    """The name of the ``number``-th node of ``kind`` (``head``, ``worker``): ``worker``, ``worker-2``..."""
    return kind if number == 1 else f"{kind}-{number}"


def node_names(workers: int) -> list[str]:
    """The node names of a cluster with ``workers`` worker nodes: ``["head", "worker", "worker-2", ...]``."""
    return [HEAD, *(node_name(WORKER, n) for n in range(1, workers + 1))]


def parse_node(node: str) -> tuple[str, int]:
    """``(kind, number)`` of a node name: ``head`` -> ``("head", 1)``, ``worker`` and ``worker-1`` ->
    ``("worker", 1)``, ``worker-2`` -> ``("worker", 2)``; ``LookupError`` for anything else."""
    kind, dash, number = node.partition("-")
    if kind == HEAD and not dash:
        return HEAD, 1
    if kind == WORKER and not dash:
        return WORKER, 1
    if kind == WORKER and number.isdigit() and not number.startswith("0"):
        return WORKER, int(number)
    raise LookupError(f"no node {node!r}: head, worker (the first worker) or worker-N")


class ClusterStartError(RuntimeError):
    """A cluster did not come up within its bound; the message carries the logs' tail."""


class Unsupported(NotImplementedError):
    """A backend cannot do this (e.g. cut a loopback node off its network): the test says so and skips."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the kernel's pick). A server we start there
    fails its start if another took it meanwhile: its log says so."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


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

    @property
    def label(self) -> str:
        """What this is, in the progress lines (``make e2e`` shows them as they happen)."""
        return type(self).__name__

    def __enter__(self) -> "Service":
        logger.info("%s: starting", self.label)
        try:
            seconds = self.up()
        except BaseException:
            logger.info("%s: did not start; bringing down what started", self.label)
            self.down()
            raise
        logger.info("%s: up in %.0f s", self.label, seconds)
        return self

    def __exit__(self, *exc: object) -> None:
        start = time.monotonic()
        self.down()
        logger.info("%s: down in %.0f s", self.label, time.monotonic() - start)


class Cluster(Service):
    """A vLLM cluster: up with a bounded wait, queried, hurt on purpose, always brought down."""

    settings: ClusterSettings
    # Whether the suites may bring this cluster down and up (restart suite, nemeses, a cluster
    # of their own): false for a cluster they only observe (``TESTBED_CLUSTER=external``).
    owned: bool = True

    @property
    def label(self) -> str:
        """``compose cluster (cgraph, broadcast upstream, detach upstream, /model)``: the settings a profile changes."""
        values = self.settings.values
        kind = type(self).__name__.removesuffix("Cluster").lower() or "a"
        return (f"{kind} cluster ({values.get('TESTBED_EXECUTOR', 'v2')}, broadcast {values.get('TESTBED_BROADCAST', '?')}, "
                f"detach {values.get('TESTBED_DETACH', '?')}, {values.get('TESTBED_MODEL', '?')})")

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

    def blind_to(self, what: str) -> str | None:
        """Why this backend cannot show ``what``, or None. ``what``: ``engine-log`` (the engine's
        and API server's own lines: transport frames, the MessageQueue timeline), ``placement``
        (ranks per node), ``mode-lines`` (each process's modes). Tests that need it skip with
        the reason."""
        return None

    def nodes(self) -> list[str]:
        """The node names the nemesis and usage operations take: the head and ``TESTBED_WORKERS``
        workers (``node_names``)."""
        settings = getattr(self, "settings", None)  # a unit test's fake cluster may have none
        return node_names(settings.workers if settings is not None else 1)

    def usage(self, node: str) -> dict[str, float]:
        """What ``node`` holds now (``node/usage.py``): ``rss_mb``, ``fds``, ``processes``, and where the
        backend sees them ``shm_mb``, ``shm_files``, ``object_store_mb``. ``make soak`` samples it."""
        raise Unsupported(f"{type(self).__name__} cannot sample a node's usage")

    # -- nemeses: what goes wrong on purpose (nemesis.py); ``node`` is one of ``nodes()`` ---------
    # Each operation below is what a backend overrides; the base class says it cannot, so a test
    # that needs one skips with the reason (``cannot``). Operations a backend cannot do, and why:
    UNSUPPORTED: dict[str, str] = {}

    def cannot(self, op: str) -> str | None:
        """Why this backend cannot do nemesis operation ``op`` (``pause``, ``isolate``...), or None."""
        if op in self.UNSUPPORTED:
            return self.UNSUPPORTED[op]
        if getattr(type(self), op, None) is getattr(Cluster, op, None):
            return f"{type(self).__name__} has no {op!r}"
        return None

    def _unsupported(self, op: str) -> NoReturn:
        raise Unsupported(f"{type(self).__name__} cannot {op}")

    def kill(self, node: str) -> None:
        """Kill every process of ``node`` at once (SIGKILL), as a lost host."""
        self._unsupported("kill")

    def pause(self, node: str) -> None:
        """Freeze every process of ``node`` (SIGSTOP, docker pause): alive, connections open, silent."""
        self._unsupported("pause")

    def resume(self, node: str) -> None:
        """Undo ``pause``; a no-op where the node is not paused."""
        self._unsupported("resume")

    def isolate(self, node: str) -> None:
        """Cut ``node`` off the cluster's network, its processes running."""
        self._unsupported("isolate")

    def rejoin(self, node: str) -> None:
        """Undo ``isolate``; a no-op where the node is not isolated or is gone."""
        self._unsupported("rejoin")

    def restart(self, node: str) -> None:
        """Stop ``node`` (bounded grace) and start it again with the same settings."""
        self._unsupported("restart")

    def signal_process(self, node: str, pattern: str, signum: int = signal.SIGKILL,
                       count: int | None = None) -> list[int]:
        """Send ``signum`` to the processes of ``node`` whose command line contains ``pattern`` (the
        first ``count`` by PID, or all), the node itself left alone; return their PIDs."""
        self._unsupported("signal_process")

    def fill_shm(self, node: str) -> int:
        """Fill the node's /dev/shm with one file of all its free bytes; return the bytes it took."""
        self._unsupported("fill_shm")

    def free_shm(self, node: str) -> None:
        """Remove ``fill_shm``'s file; a no-op where there is none or the node is gone."""
        self._unsupported("free_shm")

    def state(self, node: str) -> str:
        """Return the node's state: ``running``, ``paused``, ``isolated``, ``exited`` or ``missing``."""
        self._unsupported("state")


# The nemesis operations (the methods above), for code that walks them: nemeses name the ones they
# need, the external backend refuses each.
NEMESIS_OPERATIONS: dict[str, str] = {
    op: (getattr(Cluster, op).__doc__ or "").split("\n")[0]
    for op in ("kill", "pause", "resume", "isolate", "rejoin", "restart", "signal_process", "fill_shm", "free_shm",
               "state")
}
