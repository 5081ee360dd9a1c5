"""A leak planted on purpose, to show ``make soak`` red (``TESTBED_PLANT_LEAK``; off by default).

``outputs``: every vLLM worker keeps each output its ``execute_model`` / ``sample_tokens``
returns in a list that is never emptied, the classic leak of a server that remembers its
answers. Nothing is sent differently; the mode line says ``plant=outputs``, so a run with it never
passes for a healthy one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

PLANTS = ("outputs",)
kept: list[Any] = []
_installed = ""


def _keeping(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        if result is not None:
            kept.append(result)
        return result

    return wrapper


def install(plant: str) -> str:
    """Plant ``plant`` in this process's worker class (once); return what was planted."""
    global _installed
    if _installed or not plant:
        return _installed
    if plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}; one of {', '.join(PLANTS)}")
    from vllm.v1.worker.gpu_worker import Worker  # CPUWorker and the testbed's platform worker inherit these

    for name in ("execute_model", "sample_tokens"):
        if hasattr(Worker, name):
            setattr(Worker, name, _keeping(getattr(Worker, name)))
    _installed = plant
    return plant


def installed() -> str:
    return _installed
