"""Run a bench driver in a child process against fresh local Ray nodes; return the JSON rows it printed.

One compiled graph per process and no teardown: tearing down a compiled graph with
a cross-node channel crashed the remote raylet here
(``experimental_mutable_object_provider.cc``), so each driver prints its rows as one
JSON line and leaves with ``os._exit``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable, Sequence

from vllm_zerocopy_testbed.config import process_env


def run_driver(nodes: Sequence[Any], call: str, *, name: str, note: Callable[[str], None],
               timeout_s: float = 600) -> list[dict[str, Any]]:
    """Start ``nodes`` (``RayNodeSpec``s), run ``call`` (Python code; ``ADDRESS`` is the cluster's address)
    in a child process and return the rows of its last JSON list line; [] after a note if it printed none."""
    from vllm_zerocopy_testbed.cluster.local_ray import LocalRayCluster

    with LocalRayCluster(list(nodes)) as cluster:
        code = f"ADDRESS = {cluster.address!r}; {call}"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=process_env(RAY_ADDRESS=cluster.address))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    if not lines:
        stderr = proc.stderr.strip()
        note(f"{name} bench: the driver failed ({proc.returncode}): "
             f"{stderr.splitlines()[-1] if stderr else 'no output'}")
        return []
    return json.loads(lines[-1])
