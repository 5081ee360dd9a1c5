"""After a fault: does the cluster answer again by itself, within a bound, or must it be brought up?"""

from __future__ import annotations

import time
import urllib.error
from dataclasses import dataclass

from vllm_zerocopy_testbed.cluster.interface import Cluster, Unsupported
from vllm_zerocopy_testbed.waits import WaitAborted, WaitTimeout, wait_until
from vllm_zerocopy_testbed.workload.warmup import complete

# A node left stopped this long is not coming back by itself (Docker never restarts a container
# stopped by hand; the local backend restarts nothing).
STOPPED_FOR_GOOD_S = 20.0


def answers(base_url: str, model: str, timeout: float = 60.0) -> bool:
    """Whether a two-token completion at ``base_url`` (ending in ``/v1``) comes back with 200."""
    try:
        complete(base_url.removesuffix("/v1"), {"model": model, "prompt": [1, 2, 3], "max_tokens": 2},
                 time.monotonic() + timeout)
        return True
    except (urllib.error.URLError, OSError, ValueError):  # HTTP errors are URLErrors; bad JSON a ValueError
        return False


@dataclass(frozen=True)
class Recovery:
    how: str  # "by itself" | "make up"
    seconds: float
    why: str = ""  # why it was brought up: the wait's message

    def __str__(self) -> str:
        return f"{self.how} in {self.seconds:.0f} s"


def recover(cluster: Cluster, model: str, *, self_recovery_s: float, nodes: tuple[str, ...] = ("head", "worker"),
            poll_s: float = 5.0) -> Recovery:
    """Wait (at most ``self_recovery_s``) for ``cluster`` to answer by itself; else, or as soon as a
    node has stayed exited for ``STOPPED_FOR_GOOD_S``, bring it up (``cluster.up()``, bounded by its
    own timeout). Return how and how long."""
    start = time.monotonic()

    def stopped_for_good() -> str | None:
        if time.monotonic() - start < STOPPED_FOR_GOOD_S:
            return None
        try:
            states = {node: cluster.state(node) for node in nodes}
        except (Unsupported, LookupError):
            return None
        down = [f"{node} {state}" for node, state in states.items() if state in ("exited", "missing")]
        return f"{', '.join(down)}: nothing restarts it" if down else None

    try:
        wait_until("the cluster answers by itself", lambda: cluster.is_running() and answers(cluster.base_url, model),
                   timeout=self_recovery_s, poll_s=poll_s, abort=stopped_for_good)
        return Recovery("by itself", time.monotonic() - start)
    except (WaitAborted, WaitTimeout) as exc:
        why = str(exc).splitlines()[0]
    cluster.up()
    return Recovery("make up", time.monotonic() - start, why)
