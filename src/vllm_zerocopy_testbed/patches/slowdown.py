"""A stall injected on the engine's MessageQueue broadcast (``TESTBED_FAULT_BROADCAST``; off by default).

``stall:S``: in the engine, the first broadcast that carries a tensor of >= 1 MiB
(a large prompt_embeds request, out of band) waits ``S`` seconds before it is
sent, once: one stalled request among healthy ones, which the latency checker
must name (docs/e2e.md, "Latency: what it catches"). Wraps whatever ``enqueue``
the mode installed (``functools.wraps`` keeps ``testbed_mode``, so the mode line
stays true); nothing is sent differently.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from vllm_zerocopy_testbed.config import BroadcastFault

LARGE_BYTES = 1 << 20


def carries_large_tensor(obj: Any, depth: int = 5) -> bool:
    """Whether ``obj`` holds a torch tensor or numpy array of >= 1 MiB, looking ``depth`` levels deep."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and hasattr(obj, "shape"):
        return nbytes >= LARGE_BYTES
    if depth == 0 or isinstance(obj, (str, bytes, int, float)) or obj is None:
        return False
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ())]
    return any(carries_large_tensor(child, depth - 1) for child in children)


class _Stall:
    def __init__(self, fault: BroadcastFault) -> None:
        self.fault = fault
        self.stalled = False

    def before_send(self, obj: Any) -> None:
        if not self.stalled and carries_large_tensor(obj):
            self.stalled = True
            time.sleep(self.fault.value)


_installed: BroadcastFault | None = None


def install(fault: BroadcastFault) -> None:
    """Wrap this process's ``MessageQueue.enqueue`` with ``fault`` (once per process: the engine's)."""
    global _installed
    if _installed is not None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    state = _Stall(fault)
    send: Callable[..., None] = MessageQueue.enqueue

    @functools.wraps(send)
    def enqueue(self: Any, obj: Any, timeout: float | None = None) -> None:
        state.before_send(obj)
        return send(self, obj, timeout)

    MessageQueue.enqueue = enqueue  # type: ignore[method-assign]
    _installed = fault


def installed() -> BroadcastFault | None:
    """The fault in force in this process, if any."""
    return _installed
